"""What tracing costs on the hot path: off, sampled at 1 %, and every request.

* The router: ``Router.route`` in this process over an in-memory backend (the routing
  step alone: read, decide, attempt, account, reply), per request, with tracing off,
  then set up to export over OTLP/HTTP to a local receiver at 1 % and at 100 %
  (``spillway.tracing.configure``: the real SDK, its batching processor and exporter).
  The modes take turns, each going first in turn, so drift on the machine falls on each.
* The GPU service: three services up at once (``python -m gpu_service``; tracing off,
  ``SPILLWAY_TRACE_SAMPLE=0.01`` and ``1`` to the same receiver), driven in turn by
  ``wrk`` with the serving benchmark's mlp-bench binary request at 1 and 64 connections;
  each point the best of the rounds (noise only slows a run). The requests carry no
  ``traceparent``: each one the service samples starts its trace there.

Run: ``.venv/bin/python -m bench.trace_bench [--rounds 5] [--requests 3000]
[--seconds 4]``; prints markdown tables (docs/benchmarks.md keeps them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from bench import wrk
from bench.serving_bench import bench_repository, best, load_average
from spillway.protocol.codec import encode_request
from spillway_cli.local import procs

ROOT = Path(__file__).resolve().parents[1]
MODES = {"off": None, "1 %": "0.01", "100 %": "1"}
"""Each mode and its ``SPILLWAY_TRACE_SAMPLE`` (``None``: no endpoint, tracing off)."""
BEFORE = "before (no tracing code)"
"""The mode of ``--before``'s tree: the same measure on a checkout from before tracing."""


ROUTE_SCRIPT = """
import io, json, sys, time
sys.path.insert(0, sys.argv[1])
from spillway.policy.accounting import EmfSink
from spillway.policy.backend import BackendResponse
from spillway.policy.facts import Call
from spillway.protocol.wire import Target
from spillway.router.batch_mode import BatchBackend
from spillway.router.settings import RouterSettings
from spillway.router.wiring import Overrides, create_app

sample, endpoint, requests = sys.argv[2], sys.argv[3], int(sys.argv[4])
if sample != "off":
    from spillway import tracing
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "SPILLWAY_TRACE_SAMPLE": sample}
    tracing.configure("spillway-router-bench", environ=environ)

class Answering:
    name = "memory"
    def send(self, request, timeout_s):
        body = b'{"model_name":"digits","outputs":[]}'
        return BackendResponse(200, {"content-type": "application/json"}, body, 0.0)

backends = {"gpu": Answering(), "cpu": Answering(), "batch": BatchBackend(None)}
settings = RouterSettings(gpu_url="http://gpu.invalid", log_level="WARNING")
overrides = Overrides(backends=backends, sink=EmfSink(stream=io.StringIO()))
router = create_app(settings, overrides).router
body = b'{"inputs":[{"name":"image","shape":[1,8,8],"datatype":"FP32","data":[0]}]}'
call = Call("POST", {"content-type": "application/json"}, body, "bench")
target = Target("infer", "digits")
times = []
for n in range(requests * 2):
    started = time.perf_counter()
    router.route(call, target)
    if n >= requests:  # the first half warms up
        times.append(time.perf_counter() - started)
print(json.dumps(times))
"""
"""``Router.route`` over an in-memory backend answering at once, timed in a fresh process
of a tree (``argv``: tree, sample or ``off``, endpoint, requests)."""


def route_times(tree: Path, sample: str | None, endpoint: str, requests: int) -> list[float]:
    """Seconds per ``Router.route`` call in one fresh process of ``tree``."""
    argv = [sys.executable, "-c", ROUTE_SCRIPT, str(tree), sample or "off", endpoint]
    done = subprocess.run(
        [*argv, str(requests)], capture_output=True, text=True, check=True, timeout=600
    )
    times: list[float] = json.loads(done.stdout.strip().splitlines()[-1])
    return times


@contextmanager
def receiver(logs: Path) -> Iterator[str]:
    """The local OTLP receiver (``spillway up``'s) on a free port; its base URL."""
    port = procs.free_port()
    argv = [sys.executable, "-m", "spillway_cli.dashboard.trace_server", "--port", str(port)]
    child = procs.start("traces", argv, logs)
    base = f"http://127.0.0.1:{port}"
    try:
        procs.wait_http(f"{base}/api/health", 60, child.proc)
        yield base
    finally:
        child.stop()


def router_rows(
    endpoint: str, rounds: int, requests: int, before: Path | None
) -> dict[str, list[float]]:
    """Every mode's per-request times over every round, the modes taking turns (and the
    ``before`` tree's, tracing off, among them)."""
    times: dict[str, list[float]] = {mode: [] for mode in _modes(before)}
    for turn in range(rounds):
        for mode in _rotated(list(times), turn):
            tree = before if mode == BEFORE else ROOT
            assert tree is not None
            times[mode] += route_times(tree, MODES.get(mode), endpoint, requests)
    return times


def _rotated(modes: list[str], turn: int) -> list[str]:
    """The modes in the order of this turn: each goes first in turn, so a drift within a
    round (a warming cache, a neighbour's load) falls on each alike."""
    shift = turn % len(modes)
    return modes[shift:] + modes[:shift]


def _modes(before: Path | None) -> list[str]:
    return ([BEFORE] if before is not None else []) + list(MODES)


def service_points(
    repo: Path, logs: Path, endpoint: str, rounds: int, seconds: float, before: Path | None
) -> dict[tuple[str, int], wrk.WrkResult]:
    """mlp-bench at 1 and 64 connections on one service per mode (and the ``before``
    tree's), all up at once and driven in turn."""
    body, length = encode_request(
        {"input": np.random.default_rng(1).standard_normal((1, 1024), dtype=np.float32)},
        binary=True,
        binary_outputs=True,
    )
    request = wrk.Body(body, length, "application/octet-stream")
    children: list[procs.Child] = []
    urls: dict[str, str] = {}
    try:
        for mode in _modes(before):
            sample = MODES.get(mode)
            port = procs.free_port()
            env = {"GPU_REPOSITORY": str(repo), "GPU_LOG_LEVEL": "WARNING", "GPU_PORT": str(port)}
            if sample is not None:
                env |= {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "SPILLWAY_TRACE_SAMPLE": sample}
            tree = before if mode == BEFORE else ROOT
            assert tree is not None
            # That tree's packages first, whatever the working directory.
            run = "import runpy,sys;sys.path.insert(0,sys.argv.pop(1));"
            run += "runpy.run_module('gpu_service',run_name='__main__')"
            label = f"gpu-{len(children)}"
            argv = [sys.executable, "-c", run, str(tree)]
            children.append(procs.start(label, argv, logs, env))
            urls[mode] = f"http://127.0.0.1:{port}"
        for child, base in zip(children, urls.values(), strict=True):
            procs.wait_http(f"{base}/v2/health/ready", 180, child.proc)
            wrk.run(f"{base}/v2/models/mlp-bench/infer", request, 8, 1)  # warm-up
        runs: dict[tuple[str, int], list[wrk.WrkResult]] = {}
        for turn in range(rounds):
            for concurrency in (1, 64):
                for mode in _rotated(list(urls), turn):
                    base = urls[mode]
                    url = f"{base}/v2/models/mlp-bench/infer"
                    result = wrk.run(url, request, concurrency, seconds)
                    runs.setdefault((mode, concurrency), []).append(result)
        return {key: best(results) for key, results in runs.items()}
    finally:
        for child in children:
            child.stop()


def spans_received(base: str) -> int:
    """Spans the receiver holds (a stopped service flushed its spans as it ended)."""
    with urllib.request.urlopen(f"{base}/api/health", timeout=10) as answer:  # noqa: S310
        return int(json.loads(answer.read())["spans"])


def report(
    times: dict[str, list[float]], points: dict[tuple[str, int], wrk.WrkResult], spans: int
) -> str:
    lines = [
        "| router, `Router.route` | p50 µs | p90 µs | p50 ÷ off |",
        "|---|---:|---:|---:|",
    ]
    off = statistics.median(times["off"])
    for mode, values in times.items():
        p50 = statistics.median(values)
        p90 = statistics.quantiles(values, n=10)[-1]
        lines.append(f"| {_label(mode)} | {p50 * 1e6:.1f} | {p90 * 1e6:.1f} | {p50 / off:.2f} |")
    lines += [
        "",
        "| GPU service, mlp-bench binary | c1 req/s | c1 p50 ms | c64 req/s | c64 p99 ms "
        "| req/s ÷ off (c1 / c64) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode in times:
        one, many = points[(mode, 1)], points[(mode, 64)]
        ratio_1 = one.per_s / points[("off", 1)].per_s
        ratio_64 = many.per_s / points[("off", 64)].per_s
        lines.append(
            f"| {_label(mode)} | {one.per_s:,.0f} | {one.p50_ms:.2f} | {many.per_s:,.0f} "
            f"| {many.p99_ms:.2f} | {ratio_1:.2f} / {ratio_64:.2f} |"
        )
    lines += ["", f"Spans the receiver held at the end: {spans:,}."]
    return "\n".join(lines)


def _label(mode: str) -> str:
    return mode if mode == BEFORE else f"tracing {mode}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="turns of every mode")
    parser.add_argument("--requests", type=int, default=3000, help="router requests a turn")
    parser.add_argument("--seconds", type=float, default=4.0, help="wrk seconds a point")
    parser.add_argument("--models", type=Path, default=ROOT / "models")
    parser.add_argument(
        "--before", type=Path, help="a checkout from before tracing: its router and service too"
    )
    args = parser.parse_args(argv)
    if not wrk.available():
        sys.exit("the GPU service points need wrk (apt install wrk)")
    with tempfile.TemporaryDirectory(prefix="trace-bench-") as scratch:
        logs, repo = Path(scratch) / "logs", Path(scratch) / "repo"
        logs.mkdir()
        bench_repository(args.models, repo)
        print(f"load average before: {load_average()}")
        with receiver(logs) as base:
            times = router_rows(base, args.rounds, args.requests, args.before)
            rounds = max(1, args.rounds // 2)
            points = service_points(repo, logs, base, rounds, args.seconds, args.before)
            spans = spans_received(base)
        print(f"load average after: {load_average()}")
        print(report(times, points, spans))


if __name__ == "__main__":
    main()
