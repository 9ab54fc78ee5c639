"""The CPU fallback function's cold start, as Lambda reports one: its init (the handler
module imported: settings, models, the application) and then its first invocation, a
direct-invoke ``digits`` request, each in a fresh interpreter.

Two initialisations, by ``AWS_LAMBDA_INITIALIZATION_TYPE`` (``CPU_PRELOAD`` unset):

* ``on-demand``: a cold start with a request waiting; init loads no model, the first
  invocation loads ``digits`` alone;
* ``provisioned-concurrency``: init loads every served version (the repository's 11
  models and pipelines), so the first invocation loads nothing.

The repository is a folder (``--models``; a deployed function reads S3 into /tmp, which
adds each downloaded model's transfer to whichever phase loads it). Wall clock from the
interpreter's start, so the interpreter's own start-up counts in init as in Lambda's
``Init Duration``.

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

ROOT = Path(__file__).resolve().parents[1]
INITIALISATIONS = ("on-demand", "provisioned-concurrency")
_COLD = """
import json, sys, time
started = float(sys.argv[1])
import functions.cpu_infer.handler as function
from tests.lambda_context import LambdaContext
initialised = time.time()
event = {"model": "digits", "body": {"inputs": [
    {"name": "image", "shape": [1, 8, 8], "datatype": "FP32", "data": [8.0] * 64}]}}
answer = function.handler(event, LambdaContext())
answered = time.time()
again = function.handler(event, LambdaContext())
warm = time.time() - answered
print(json.dumps({"init": initialised - started, "first": answered - initialised,
                  "warm": warm, "status": answer["statusCode"], "again": again["statusCode"],
                  "loaded": sorted(function.service.models)}))
"""


def cold_start(models: Path, initialisation: str) -> dict[str, object]:
    """One cold start in a fresh interpreter: init and first invocation, in seconds."""
    with tempfile.TemporaryDirectory(prefix="spillway-cold-") as cache:
        env = {
            **os.environ,
            "AWS_LAMBDA_INITIALIZATION_TYPE": initialisation,
            "CPU_REPOSITORY": str(models),
            "CPU_CACHE_DIR": cache,
            "CPU_LOG_LEVEL": "WARNING",
            "POWERTOOLS_METRICS_NAMESPACE": "Spillway",
        }
        env.pop("CPU_PRELOAD", None)
        started = time.time()
        done = subprocess.run(
            [sys.executable, "-c", _COLD, repr(started)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=600,
        )
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=ROOT / "models")
    parser.add_argument("--runs", type=int, default=7, help="cold starts per initialisation")
    args = parser.parse_args()
    models = args.models.resolve()
    runs: dict[str, list[dict[str, object]]] = {kind: [] for kind in INITIALISATIONS}
    for _ in range(args.runs):  # interleaved: drift in the machine's load hits both
        for kind in INITIALISATIONS:
            runs[kind].append(cold_start(models, kind))
    print(
        "| initialisation | init (p50 / max) | first digits answer (p50 / max) | "
        "init + first (p50) | a warm answer (p50) | loaded after it |"
    )
    print("|---|---:|---:|---:|---:|---|")
    for kind, results in runs.items():
        assert {r["status"] for r in results} == {200}, results
        init = [float(r["init"]) * 1e3 for r in results]  # type: ignore[arg-type]
        first = [float(r["first"]) * 1e3 for r in results]  # type: ignore[arg-type]
        warm = [float(r["warm"]) * 1e3 for r in results]  # type: ignore[arg-type]
        total = [a + b for a, b in zip(init, first, strict=True)]
        loaded = results[-1]["loaded"]
        print(
            f"| {kind} | {statistics.median(init):.0f} / {max(init):.0f} ms "
            f"| {statistics.median(first):.0f} / {max(first):.0f} ms "
            f"| {statistics.median(total):.0f} ms | {statistics.median(warm):.1f} ms "
            f"| {len(loaded)}: {', '.join(loaded)} |"  # type: ignore[arg-type]
        )


if __name__ == "__main__":
    main()
