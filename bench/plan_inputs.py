"""The measured inputs of ``spillway plan`` and ``spillway tune``, from one run on this
machine, written to ``config/measured.yaml``.

Per model:

* **dedicated** — the GPU service (one process, every model resident) under closed-loop
  loads at concurrency 1, 8 and 32: rows per second and p50/p99 latency at each, and the
  version's load time (``spillway_model_load_seconds``);
* **serverless** — the CPU fallback with only that model, as one Lambda environment: the
  time from process start until it is ready (the cold start), then one request at a time
  (p50, p99, mean);
* **batch** — the batch job's runner over a folder of records at the model's
  ``max_batch_size`` (records per second, model load excluded); the same figure stands
  for the function working through offline records, both being ONNX Runtime on the
  providers given.

    .venv/bin/python -m bench.plan_inputs [--quick] [--providers CPUExecutionProvider]
"""

from __future__ import annotations

import argparse
import datetime as dt
import http.client
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from bench.lifecycle_bench import metric
from bench.lifecycle_bench import start as start_gpu_service
from bench.loadgen import LoadResult, http_request, run_load
from bench.serving_bench import texts
from spillway.protocol.codec import encode_request
from spillway_cli.local import procs

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("digits", "minilm", "mlp-bench")
LOADS = ((1, 200), (8, 1600), (32, 3200))
RECORDS = {"digits": 4096, "minilm": 512, "mlp-bench": 8192}


def inputs(model: str, count: int, seed: int) -> list[dict[str, np.ndarray]]:
    """``count`` single-row inputs of ``model``."""
    rng = np.random.default_rng(seed)
    if model == "digits":
        return [{"image": rng.random((1, 8, 8), dtype=np.float32) * 16} for _ in range(count)]
    if model == "mlp-bench":
        return [{"input": rng.standard_normal((1, 1024), dtype=np.float32)} for _ in range(count)]
    return [{"text": np.array([[t.encode()]], np.object_)} for t in texts(count, 8, 64, seed)]


def requests(model: str, count: int, seed: int) -> list[bytes]:
    """Prepared HTTP requests (binary tensors, JSON for text)."""
    prepared = []
    for feed in inputs(model, count, seed):
        binary = model != "minilm"
        body, length = encode_request(feed, binary=binary, binary_outputs=binary)
        kind = "application/octet-stream" if binary else "application/json"
        prepared.append(http_request(f"/v2/models/{model}/infer", body, length, kind))
    return prepared


def figures(result: LoadResult) -> dict[str, float]:
    if result.ok != sum(result.statuses.values()):
        raise RuntimeError(f"a load had failures: {result.statuses}")
    return {
        "rows_per_s": round(result.ok / result.wall_s, 1),
        "p50_ms": round(result.percentile(50) * 1e3, 2),
        "p99_ms": round(result.percentile(99) * 1e3, 2),
    }


def frontier(points: list[dict[str, float]]) -> list[dict[str, float]]:
    """The loads worth planning with, by throughput: a load that sustained less than
    another yet saw a higher p99 (a noisy run) says nothing the other does not."""
    ordered = sorted(points, key=lambda p: p["rows_per_s"])
    return [
        p for i, p in enumerate(ordered) if all(p["p99_ms"] < q["p99_ms"] for q in ordered[i + 1 :])
    ]


def dedicated(models: Path, providers: list[str], scale: float, logs: Path) -> dict[str, Any]:
    child, port = start_gpu_service(models, logs, providers=json.dumps(providers))
    out: dict[str, Any] = {}
    try:
        procs.wait_http(f"http://127.0.0.1:{port}/v2/health/ready", 180, child.proc)
        for model in MODELS:
            run_load(port, requests(model, 50, 0), 4)  # warm the path, not counted
            points = []
            for concurrency, count in LOADS:
                result = run_load(
                    port, requests(model, int(count * scale), concurrency), concurrency
                )
                points.append({"concurrency": concurrency, **figures(result[0])})
            out[model] = {
                "points": frontier(points),
                "load_ms": round(
                    metric(port, "spillway_model_load_seconds", f'model="{model}"') * 1e3, 1
                ),
            }
    finally:
        child.stop()
    return out


def serverless(model: str, models: Path, scale: float, logs: Path) -> dict[str, float]:
    port = procs.free_port()
    argv = [sys.executable, "-m", "spillway_cli.main", "serve", "cpu", "--port", str(port)]
    env = {
        "CPU_REPOSITORY": str(models),
        "CPU_MODELS": json.dumps([model]),
        "CPU_LOG_LEVEL": "WARNING",
    }
    started = time.monotonic()
    child = procs.start(f"cpu-{model}", argv, logs, env)
    try:
        procs.wait_http(f"http://127.0.0.1:{port}/v2/health/ready", 180, child.proc)
        init_ms = (time.monotonic() - started) * 1e3
        result = one_at_a_time(port, model, int(400 * scale))
    finally:
        child.stop()
    return {
        "p50_ms": figures(result)["p50_ms"],
        "p99_ms": figures(result)["p99_ms"],
        "mean_ms": round(float(np.mean(result.latencies)) * 1e3, 2),
        "init_ms": round(init_ms, 1),
    }


def one_at_a_time(port: int, model: str, count: int) -> LoadResult:
    """``count`` requests in a row, as one Lambda environment serves them (the local
    server closes each connection, so each request opens its own)."""
    result = LoadResult()
    started = time.perf_counter()
    for feed in inputs(model, count, 99):
        binary = model != "minilm"
        body, length = encode_request(feed, binary=binary, binary_outputs=binary)
        headers = {"Content-Type": "application/octet-stream" if binary else "application/json"}
        if length is not None:
            headers["Inference-Header-Content-Length"] = str(length)
        sent = time.perf_counter()
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.request("POST", f"/v2/models/{model}/infer", body=body, headers=headers)
        response = connection.getresponse()
        response.read()
        connection.close()
        result.latencies.append(time.perf_counter() - sent)
        result.statuses[response.status] = result.statuses.get(response.status, 0) + 1
    result.wall_s = time.perf_counter() - started
    return result


def records(model: str, count: int) -> dict[str, bytes]:
    """Input files of the batch job: ``.npy`` for mlp-bench, JSON Lines otherwise."""
    if model == "mlp-bench":
        buffer = io.BytesIO()
        np.save(buffer, np.random.default_rng(5).standard_normal((count, 1024), dtype=np.float32))
        return {"000.npy": buffer.getvalue()}
    lines = []
    for i, feed in enumerate(inputs(model, count, 5)):
        ((name, value),) = feed.items()
        data = value[0].tolist() if name != "text" else value[0, 0].decode()
        lines.append(json.dumps({"id": str(i), "data": {name: data}}))
    return {"000.jsonl": ("\n".join(lines) + "\n").encode()}


def batch(
    model: str, models: Path, providers: list[str], scale: float, work: Path
) -> dict[str, Any]:
    from batch_job.plan import Locations, RunSpec, ensure_plan
    from batch_job.runner import load_model
    from batch_job.settings import JobsSettings
    from bench.jobs_bench import time_job
    from spillway.models.repository import open_repository

    settings = JobsSettings(
        repository=str(models), providers=tuple(providers), work_dir=work, progress_bar=False
    )
    folder = work / model / "in"
    folder.mkdir(parents=True)
    for name, body in records(model, int(RECORDS[model] * scale)).items():
        (folder / name).write_bytes(body)
    repo = open_repository(str(models))
    rates = []
    loaded: Any = None
    for attempt in range(3):  # the first warms up; the best of the other two counts
        spec = RunSpec(model, str(folder), str(work / model / f"out{attempt}"))
        where = Locations.of(spec)
        plan = ensure_plan(spec, repo, where)
        loaded = loaded or load_model(repo, settings, plan)
        rates.append(time_job(spec, settings, plan, loaded, where)[0])
    return {"rows_per_s": round(max(rates[1:]), 1), "batch_size": loaded.config.max_batch_size}


def step(what: str) -> None:
    print(f"measuring {what} ...", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default=os.environ.get("SPILLWAY_MODELS_DIR", "models"))
    parser.add_argument("--providers", default="CPUExecutionProvider")
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests")
    parser.add_argument("--out", default=str(ROOT / "config" / "measured.yaml"))
    parser.add_argument("--machine", default=f"{os.cpu_count()} CPU cores, no GPU")
    args = parser.parse_args(argv)
    scale = 0.25 if args.quick else 1.0
    models, providers = Path(args.models), args.providers.split(",")
    work = Path(tempfile.mkdtemp(prefix="spillway-plan-inputs-"))
    busy_before = os.getloadavg()[0]
    step("the GPU service")
    gpu = dedicated(models, providers, scale, work)
    measured: dict[str, Any] = {}
    for model in MODELS:
        step(f"{model}: the CPU fallback and the batch job")
        cpu = serverless(model, models, scale, work)
        job = batch(model, models, providers, scale, work)
        cpu["offline_rows_per_s"] = job["rows_per_s"]
        measured[model] = {"dedicated": gpu[model], "serverless": cpu, "batch": job}
    # On a shared machine other work competes for the cores: the figures say how much.
    load = max(os.getloadavg()[1], busy_before)
    document = {
        "measured_on": dt.date.today().isoformat(),
        "machine": f"{args.machine} (ONNX Runtime {', '.join(providers)}; "
        f"load average {load:.1f} while measuring)",
        "providers": providers,
        "models": measured,
    }
    head = (
        "# Measured inputs of `spillway plan` and `spillway tune`, written by\n"
        "# `python -m bench.plan_inputs` (bench/plan_inputs.py says what each figure is).\n"
        "# Re-run it on the hardware you deploy on: these figures are the machine's below.\n"
    )
    Path(args.out).write_text(head + yaml.safe_dump(document, sort_keys=False))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
