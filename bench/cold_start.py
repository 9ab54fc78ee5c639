"""Cold starts of the Lambda functions, as Lambda reports one: init (the handler module
imported: settings, models, the application) and then the first invocation, each in a
fresh interpreter.

The CPU fallback function answers a direct-invoke ``digits`` request after each of two
initialisations, by ``AWS_LAMBDA_INITIALIZATION_TYPE`` (``CPU_PRELOAD`` unset):

* ``on-demand``: a cold start with a request waiting; init loads no model, the first
  invocation loads ``digits`` alone;
* ``provisioned-concurrency``: init loads every served version, so the first invocation
  loads nothing.

Its repository is a folder (``--models``; a deployed function reads S3 into /tmp, which
adds each downloaded model's transfer to whichever phase loads it). The router, jobs and
WebSocket functions answer an event that needs no AWS call (their init is what they
cost; their requests' own work is measured elsewhere). Wall clock from the interpreter's
start, so the interpreter's own start-up counts in init, as in Lambda's ``Init
Duration``.

Run: ``.venv/bin/python -m bench.cold_start --models models [--runs 7]``; prints a
markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
INITIALISATIONS = ("on-demand", "provisioned-concurrency")
_COLD = """
import importlib, json, sys, time
started = float(sys.argv[1])
function = importlib.import_module(sys.argv[2])
from tests.lambda_context import LambdaContext
initialised = time.time()
with open(sys.argv[3]) as file:
    event = json.load(file)
answer = function.handler(event, LambdaContext())
answered = time.time()
again = function.handler(event, LambdaContext())
warm = time.time() - answered
service = getattr(function, "service", None)
print(json.dumps({"init": initialised - started, "first": answered - initialised,
                  "warm": warm, "status": answer["statusCode"], "again": again["statusCode"],
                  "loaded": sorted(service.models) if service is not None else []}))
"""
DIGITS = {
    "model": "digits",
    "body": {
        "inputs": [{"name": "image", "shape": [1, 8, 8], "datatype": "FP32", "data": [8.0] * 64}]
    },
}
QUIET = {"ROUTER_METRICS_LOG": os.devnull, "ROUTER_LOG_LEVEL": "WARNING", "ROUTER_GPU_URL": ""}


def _event(path: str) -> dict[str, Any]:
    event: dict[str, Any] = json.loads((ROOT / "events" / path).read_text())
    return event


def _anonymous(event: dict[str, Any]) -> dict[str, Any]:
    event["requestContext"]["identity"]["apiKeyId"] = None  # refused before any AWS call
    return event


ZIPS: dict[str, tuple[str, dict[str, Any], dict[str, str], int]] = {
    # function: (handler module, event, environment, the first answer's status)
    "router (live check)": (
        "functions.router.handler",
        _event("router/live-rest-v1.json"),
        {**QUIET, "ROUTER_POLICY_FILE": str(ROOT / "policies" / "example.yaml")},
        200,
    ),
    "jobs (a status request without an API key)": (
        "functions.jobs.handler",
        _anonymous(_event("jobs/status.json")),
        {},
        401,
    ),
    "websocket ($connect, no connection table)": (
        "functions.websocket.handler",
        _event("websocket/connect.json"),
        dict(QUIET),
        503,
    ),
}


def run_cold(module: str, event: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """One cold start of ``module``'s handler in a fresh interpreter: init, the first
    invocation with ``event`` and a warm one, in seconds."""
    with tempfile.TemporaryDirectory(prefix="spillway-cold-") as work:
        event_file = Path(work) / "event.json"
        event_file.write_text(json.dumps(event))
        environ = {**os.environ, "CPU_CACHE_DIR": work, **env}
        environ.pop("CPU_PRELOAD", None)  # the defaults are what is measured
        started = time.time()
        done = subprocess.run(
            [sys.executable, "-c", _COLD, repr(started), module, str(event_file)],
            cwd=ROOT,
            env=environ,
            capture_output=True,
            text=True,
            check=True,
            timeout=600,
        )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def cold_start(models: Path, initialisation: str) -> dict[str, Any]:
    """One cold start of the CPU function: ``digits`` on ``models``, initialised so."""
    env = {
        "AWS_LAMBDA_INITIALIZATION_TYPE": initialisation,
        "CPU_REPOSITORY": str(models),
        "CPU_LOG_LEVEL": "WARNING",
    }
    return run_cold("functions.cpu_infer.handler", DIGITS, env)


def _row(name: str, results: list[dict[str, Any]], status: int) -> str:
    assert {(r["status"], r["again"]) for r in results} == {(status, status)}, results
    init = [r["init"] * 1e3 for r in results]
    first = [r["first"] * 1e3 for r in results]
    warm = [r["warm"] * 1e3 for r in results]
    total = [a + b for a, b in zip(init, first, strict=True)]
    loaded = results[-1]["loaded"]
    return (
        f"| {name} | {statistics.median(init):.0f} / {max(init):.0f} ms "
        f"| {statistics.median(first):.0f} / {max(first):.0f} ms "
        f"| {statistics.median(total):.0f} ms | {statistics.median(warm):.1f} ms "
        f"| {len(loaded)} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=ROOT / "models")
    parser.add_argument("--runs", type=int, default=7, help="cold starts of each")
    args = parser.parse_args()
    models = args.models.resolve()
    cpu: dict[str, list[dict[str, Any]]] = {kind: [] for kind in INITIALISATIONS}
    zips: dict[str, list[dict[str, Any]]] = {name: [] for name in ZIPS}
    for _ in range(args.runs):  # interleaved: drift in the machine's load hits all
        for kind in INITIALISATIONS:
            cpu[kind].append(cold_start(models, kind))
        for name, (module, event, env, _status) in ZIPS.items():
            zips[name].append(run_cold(module, event, env))
    print(
        "| function (first event) | init (p50 / max) | first answer (p50 / max) "
        "| init + first (p50) | a warm answer (p50) | models loaded after it |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for kind, results in cpu.items():
        print(_row(f"CPU fallback, {kind} (digits, direct invoke)", results, 200))
    for name, results in zips.items():
        print(_row(name, results, ZIPS[name][3]))


if __name__ == "__main__":
    main()
