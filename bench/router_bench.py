"""Router timings: cold import of the Lambda handler, and in-process overhead per request.

* Cold import: ``import functions.router.handler`` (settings, policy, application built
  at init, as on a Lambda cold start) timed inside fresh interpreters; the interpreter's
  own start-up is reported apart.
* Overhead: the API Gateway event through ``handler`` (serverless-wsgi, routing, policy,
  deadline, cost, EMF line, JSON log line) minus the time spent in the backend, with an
  in-memory backend, and with the pooled HTTP client against a local HTTP server.

Run: ``.venv/bin/python bench/router_bench.py [--runs 15] [--requests 3000]``; prints a
markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aws_lambda_powertools.logging import Logger

ROOT = Path(__file__).resolve().parents[1]
EVENT = ROOT / "events" / "router" / "infer-http-v2.json"
POLICY = ROOT / "policies" / "example.yaml"
RESULT = json.dumps(
    {
        "model_name": "digits",
        "model_version": "1",
        "outputs": [{"name": "label", "datatype": "INT64", "shape": [1, 1], "data": [2]}],
    }
).encode()
_IMPORT = (
    "import time; t, c = time.perf_counter(), time.process_time(); "
    "import functions.router.handler; "
    "print(time.perf_counter() - t, time.process_time() - c)"
)


def cold_import(runs: int) -> tuple[list[float], list[float], list[float]]:
    """Seconds to import the handler (wall clock and CPU time), and to start a bare
    interpreter, in fresh processes. CPU time hardly moves with other load on the host."""
    env = {
        **os.environ,
        "ROUTER_POLICY_FILE": str(POLICY),
        "ROUTER_METRICS_LOG": os.devnull,
        "ROUTER_LOG_LEVEL": "WARNING",
    }
    imports, cpu, bare = [], [], []
    for _ in range(runs):
        done = subprocess.run(
            [sys.executable, "-c", _IMPORT], env=env, cwd=ROOT, capture_output=True, check=True
        )
        wall, used = done.stdout.decode().split()[-2:]
        imports.append(float(wall))
        cpu.append(float(used))
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], cwd=ROOT, check=True)
        bare.append(time.perf_counter() - started)
    return imports, cpu, bare


class _Context:
    function_name = "spillway-router"
    function_version = "$LATEST"
    invoked_function_arn = "arn:aws:lambda:us-east-1:123456789012:function:spillway-router"
    memory_limit_in_mb = 512
    aws_request_id = "bench"

    def get_remaining_time_in_millis(self) -> int:
        return 30_000


class _MemoryBackend:
    name = "gpu"

    def send(self, request: Any, timeout_s: float) -> Any:
        from spillway.policy.backend import BackendResponse

        started = time.perf_counter()
        answer = BackendResponse(200, {"content-type": "application/json"}, RESULT, 0.0)
        return BackendResponse(
            answer.status, answer.headers, answer.body, time.perf_counter() - started
        )


_SERVER = """
import http.server, sys
RESULT = sys.argv[2].encode()
class Answer(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # as uvicorn (asyncio) does
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(RESULT)))
        self.end_headers()
        self.wfile.write(RESULT)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Answer).serve_forever()
"""


def _backend_process() -> tuple[subprocess.Popen[bytes], int]:
    """A stand-in GPU service in its own process (so it takes no GIL from the router)."""
    from spillway_cli.local.procs import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(port), RESULT.decode()])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return proc, port
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the stand-in backend did not start")


def _handler(
    backend: Any, logger: Logger
) -> tuple[Callable[[dict[str, Any], Any], dict[str, Any]], list[float]]:
    """The Lambda handler over one backend, and the list its backend times go to."""
    import serverless_wsgi

    from spillway.policy.accounting import EmfSink
    from spillway.router.settings import RouterSettings
    from spillway.router.wiring import Overrides, create_app

    backend_times: list[float] = []

    class Timed:
        name = "gpu"

        def send(self, request: Any, timeout_s: float) -> Any:
            response = backend.send(request, timeout_s)
            backend_times.append(response.elapsed_s)
            return response

    settings = RouterSettings(policy_file=POLICY)
    app = create_app(
        settings, Overrides(backends={"gpu": Timed()}, sink=EmfSink(stream=io.StringIO()))
    )

    @logger.inject_lambda_context(correlation_id_path="requestContext.requestId")
    def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
        response: dict[str, Any] = serverless_wsgi.handle_request(app, event, context)
        return response

    return handler, backend_times


def overhead(backend: Any, logger: Logger, requests: int) -> list[float]:
    """Seconds of handler time that were not backend time, per request."""
    handler, backend_times = _handler(backend, logger)
    event = json.loads(EVENT.read_text())
    context = _Context()
    for _ in range(200):
        assert handler(event, context)["statusCode"] == 200
    backend_times.clear()
    totals = []
    for _ in range(requests):
        started = time.perf_counter()
        handler(event, context)
        totals.append(time.perf_counter() - started)
    return [total - spent for total, spent in zip(totals, backend_times, strict=True)]


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="fresh processes for cold import")
    parser.add_argument("--requests", type=int, default=3000, help="requests per overhead row")
    args = parser.parse_args()

    imports, cpu, bare = cold_import(args.runs)
    from aws_lambda_powertools.logging import Logger

    # As in the handler: one JSON log line per request (written to memory here).
    logger = Logger(
        service="spillway.router", level="INFO", logger_handler=logging.StreamHandler(io.StringIO())
    )
    memory = overhead(_MemoryBackend(), logger, args.requests)
    from spillway.router.backends import HttpBackend

    proc, port = _backend_process()
    try:
        pooled = overhead(HttpBackend("gpu", f"http://127.0.0.1:{port}"), logger, args.requests)
    finally:
        proc.terminate()
        proc.wait(10)

    ms = 1000.0
    print(
        f"Router timings ({args.runs} fresh processes; {args.requests} requests per row; "
        f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs)\n"
    )
    print("| measure | p50 | p90 | p99 | target |")
    print("|---|---:|---:|---:|---|")
    print(
        f"| cold import of the handler (init included) | {statistics.median(imports) * ms:.0f} ms "
        f"| {_quantile(imports, 0.9) * ms:.0f} ms | max {max(imports) * ms:.0f} ms | ≤ 300 ms |"
    )
    print(
        f"| cold import, CPU time of the importing process | {statistics.median(cpu) * ms:.0f} ms "
        f"| {_quantile(cpu, 0.9) * ms:.0f} ms | max {max(cpu) * ms:.0f} ms | |"
    )
    print(
        f"| bare interpreter start (for reference) | {statistics.median(bare) * ms:.0f} ms "
        f"| {_quantile(bare, 0.9) * ms:.0f} ms | | |"
    )
    for name, values in (("in-memory backend", memory), ("pooled HTTP backend", pooled)):
        print(
            f"| handler overhead, {name} | {_quantile(values, 0.5) * ms:.3f} ms "
            f"| {_quantile(values, 0.9) * ms:.3f} ms | {_quantile(values, 0.99) * ms:.3f} ms "
            f"| p50 ≤ 1 ms |"
        )


if __name__ == "__main__":
    main()
