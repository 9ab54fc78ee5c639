"""The GPU service on CUDA against raw ONNX Runtime CUDA, one prepared run (``make
bench-gpu``, a few minutes).

Three models, each with max batch 64 and a 5 ms queue delay: mlp-bench (one binary row
per request), minilm fed pre-tokenised ids (16 tokens), and a ResNet-50-shaped CNN with
random weights (``bench/resnet.py``; one 3x224x224 image per request, 602 KB binary).

* **Raw**: each graph in an ONNX Runtime session on the same providers, timed at batch 1,
  8, 32 and 64 (p50 of single runs; rows/s of back-to-back runs), numpy in and out, so
  host-device copies are counted as the service pays them.
* **Service**: ``python -m gpu_service`` on 127.0.0.1 in explicit mode; each model is
  loaded alone, its footprint read from the service's ``spillway_model_memory_bytes``
  (device memory growth through NVML on CUDA, resident-set growth on the CPU), driven at
  concurrency 1, 8 and 64 by a load generator of several processes (so the client is not
  the limit), then unloaded.
* **Goal**: service rows/s at c64 >= 0.9 x raw rows/s at batch 64.

Writes the table to stdout and, with ``--out``, to ``bench-gpu.md`` there. ``--quick``
runs a small CNN for a fraction of a second per point on whatever providers are given:
the CPU test of this script (``tests/integration/test_gpu_bench.py``).

    .venv-gpu/bin/python -m bench.gpu_bench [--seconds 8] [--out docs]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from tokenizers import Tokenizer

from bench import resnet
from bench.loadgen import exchange, http_request
from bench.serving_bench import start_service
from spillway.models.repository import sha256_file
from spillway.protocol.codec import encode_request
from spillway_cli.local import procs

ROOT = Path(__file__).resolve().parents[1]
MAX_BATCH = 64
DELAY_US = 5000
BATCHES = (1, 8, 32, 64)
CONCURRENCIES = (1, 8, 64)
GOAL = 0.9
Feeds = dict[str, np.ndarray]


@dataclass
class Model:
    """One benchmark model: its repository name, a request's feeds, and batch feeds."""

    name: str
    feeds: Callable[[int], Feeds]
    path: Path = Path()


@dataclass
class Served:
    """One load point against the service."""

    concurrency: int
    rows_per_s: float
    p50_ms: float
    p99_ms: float
    mean_batch: float
    errors: int


@dataclass
class Row:
    """Everything measured for one model."""

    name: str
    raw_p50_ms: dict[int, float] = field(default_factory=dict)
    raw_rows_per_s: dict[int, float] = field(default_factory=dict)
    served: list[Served] = field(default_factory=list)
    memory_mb: float | None = None


# -- the models ----------------------------------------------------------------------------


def build_repository(models: Path, dest: Path, quick: bool) -> list[Model]:
    """mlp-bench, minilm-ids and resnet50 with the same batching knobs."""
    rng = np.random.default_rng(0)
    tokenizer = Tokenizer.from_file(str(models / "minilm/1/tokenizer.json"))
    tokenizer.no_padding()
    ids = np.array([tokenizer.encode("the quick brown fox jumps over the dog " * 2).ids[:16]])

    def minilm(n: int) -> Feeds:
        batch = np.repeat(ids, n, axis=0).astype(np.int64)
        return {"input_ids": batch, "attention_mask": np.ones_like(batch)}

    mlp_x = rng.standard_normal((MAX_BATCH, 1024), dtype=np.float32)
    width, size = (16, 64) if quick else (1, 224)
    images = rng.standard_normal((MAX_BATCH, 3, size, size), dtype=np.float32)
    out = [
        Model("mlp-bench", lambda n: {"input": mlp_x[:n]}),
        Model("minilm-ids", minilm),
        Model("resnet50", lambda n: {resnet.INPUT: images[:n]}),
    ]
    for name in ("mlp-bench", "minilm"):
        config = json.loads((models / name / "config.json").read_text())
        if name == "minilm":
            config["name"] = "minilm-ids"
            config["input"] = [
                {"name": n, "data_type": "TYPE_INT64", "dims": [-1]}
                for n in ("input_ids", "attention_mask")
            ]
            config["spillway"] = {"kind": "tensor", "onnx_file": "model.onnx", "length_buckets": []}
        config["max_batch_size"] = MAX_BATCH
        batching = config.setdefault("dynamic_batching", {})
        batching["preferred_batch_size"] = []
        batching["max_queue_delay_microseconds"] = DELAY_US
        _version(dest, config, (models / name / "1" / "model.onnx").resolve())
    onnx_path = dest / "resnet50.onnx"
    onnx.save(resnet.resnet50(width=width, size=size), onnx_path)
    _version(dest, resnet.config("resnet50", MAX_BATCH, DELAY_US, size), onnx_path)
    for model in out:
        model.path = dest / model.name / "1" / "model.onnx"
    return out


def _version(dest: Path, config: dict[str, object], onnx_file: Path) -> None:
    version = dest / str(config["name"]) / "1"
    version.mkdir(parents=True)
    (version / "model.onnx").symlink_to(onnx_file)
    (version / "SHA256SUMS").write_text(f"{sha256_file(version / 'model.onnx')}  model.onnx\n")
    (version.parent / "config.json").write_text(json.dumps(config))


# -- raw ONNX Runtime ----------------------------------------------------------------------


def raw(model: Model, providers: list[str], seconds: float, row: Row) -> None:
    """p50 latency and rows/s at each batch size, straight through ONNX Runtime."""
    session = ort.InferenceSession(str(model.path), providers=providers)
    for batch in BATCHES:
        feeds = model.feeds(batch)
        for _ in range(5):
            session.run(None, feeds)
        times: list[float] = []
        started = time.perf_counter()
        while len(times) < 5 or time.perf_counter() - started < seconds:
            begun = time.perf_counter()
            session.run(None, feeds)
            times.append(time.perf_counter() - begun)
        row.raw_p50_ms[batch] = float(np.percentile(times, 50)) * 1e3
        row.raw_rows_per_s[batch] = batch * len(times) / sum(times)


# -- the load generator --------------------------------------------------------------------


def _drive(
    port: int, request: bytes, connections: int, seconds: float
) -> tuple[list[float], float]:
    """One process's share: ``connections`` keep-alive clients until the time is up;
    each answer's latency (negative: an answer that was not 200), and the time taken."""
    import uvloop

    async def client(latencies: list[float], deadline: float) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                status = await exchange(reader, writer, request)
                took = time.perf_counter() - started
                latencies.append(took if status == 200 else -took)
        finally:
            writer.close()

    async def main() -> tuple[list[float], float]:
        latencies: list[float] = []
        started = time.perf_counter()
        await asyncio.gather(*(client(latencies, started + seconds) for _ in range(connections)))
        return latencies, time.perf_counter() - started

    return uvloop.run(main())


def drive(port: int, request: bytes, concurrency: int, seconds: float) -> tuple[list[float], float]:
    """``concurrency`` clients spread over up to half the cores' processes: every
    latency, and the answers per second (each process's count over its own time, so
    starting the processes is not counted)."""
    processes = max(1, min(concurrency, (os.cpu_count() or 2) // 2, 8))
    shares = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    context = multiprocessing.get_context("spawn")
    with context.Pool(processes) as pool:
        parts = pool.starmap(_drive, [(port, request, n, seconds) for n in shares])
    ok_per_s = sum(sum(t >= 0 for t in times) / took for times, took in parts)
    return [t for times, _ in parts for t in times], ok_per_s


# -- the service -----------------------------------------------------------------------------


def _call(base: str, path: str, method: str = "GET") -> bytes:
    data = b"" if method == "POST" else None
    request = urllib.request.Request(f"{base}{path}", data=data)  # noqa: S310
    with urllib.request.urlopen(request, timeout=600) as response:  # noqa: S310
        return bytes(response.read())


def _executions(base: str, name: str) -> dict[int, int]:
    entry = json.loads(_call(base, f"/v2/models/{name}/stats"))["model_stats"][0]
    return {b["batch_size"]: b["compute_infer"]["count"] for b in entry["batch_stats"]}


def _memory_mb(base: str, name: str) -> float | None:
    prefix = f'spillway_model_memory_bytes{{model="{name}"'
    for line in _call(base, "/metrics").decode().splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1]) / 1e6
    return None


def served(base: str, port: int, model: Model, seconds: float, row: Row) -> None:
    """Load the model alone, measure its footprint, drive it, unload it."""
    _call(base, f"/v2/repository/models/{model.name}/load", "POST")
    row.memory_mb = _memory_mb(base, model.name)
    body, length = encode_request(model.feeds(1), binary=True, binary_outputs=True)
    request = http_request(
        f"/v2/models/{model.name}/infer", body, length, "application/octet-stream"
    )
    drive(port, request, 8, min(1.0, seconds))  # warm-up
    for concurrency in CONCURRENCIES:
        before = _executions(base, model.name)
        latencies, ok_per_s = drive(port, request, concurrency, seconds)
        after = _executions(base, model.name)
        formed = {k: v - before.get(k, 0) for k, v in after.items()}
        runs = sum(formed.values())
        ok = [t for t in latencies if t >= 0]
        row.served.append(
            Served(
                concurrency,
                ok_per_s,
                float(np.percentile(ok, 50)) * 1e3 if ok else float("nan"),
                float(np.percentile(ok, 99)) * 1e3 if ok else float("nan"),
                sum(k * v for k, v in formed.items()) / runs if runs else 0.0,
                len(latencies) - len(ok),
            )
        )
    _call(base, f"/v2/repository/models/{model.name}/unload", "POST")


def measure_service(
    repo: Path, logs: Path, providers: list[str], models: list[Model], seconds: float
) -> dict[str, Row]:
    rows = {m.name: Row(m.name) for m in models}
    explicit = {"GPU_MODEL_CONTROL_MODE": "explicit", "GPU_STARTUP_MODELS": "[]"}
    child, port = start_service("gpu-bench", repo, logs, providers, explicit)
    base = f"http://127.0.0.1:{port}"
    try:
        procs.wait_http(f"{base}/v2/health/live", 180, child.proc)
        for model in models:
            served(base, port, model, seconds, rows[model.name])
    finally:
        child.stop()
    return rows


# -- the report ----------------------------------------------------------------------------


def report(rows: list[Row], providers: list[str], device: str) -> str:
    lines = [
        f"Providers: {', '.join(providers)}; device: {device}; {os.cpu_count()} CPUs.",
        "",
        "| model | raw b1 p50 ms | raw rows/s b1 / b8 / b32 / b64 | service c1 p50 ms "
        "| service rows/s c1 / c8 / c64 | mean batch c64 | c64 / raw b64 | goal >= "
        f"{GOAL} | memory MB | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for row in rows:
        by_c = {s.concurrency: s for s in row.served}
        raw_rates = " / ".join(f"{row.raw_rows_per_s[b]:,.0f}" for b in BATCHES)
        served_rates = " / ".join(f"{by_c[c].rows_per_s:,.0f}" for c in CONCURRENCIES)
        ratio = by_c[64].rows_per_s / row.raw_rows_per_s[64]
        memory = "n/a" if row.memory_mb is None else f"{row.memory_mb:,.0f}"
        lines.append(
            f"| {row.name} | {row.raw_p50_ms[1]:.2f} | {raw_rates} | {by_c[1].p50_ms:.2f} | "
            f"{served_rates} | {by_c[64].mean_batch:.1f} | {ratio:.2f} | "
            f"{'yes' if ratio >= GOAL else 'no'} | {memory} | "
            f"{sum(s.errors for s in row.served)} |"
        )
    return "\n".join(lines)


def device_name(providers: list[str]) -> str:
    if "CUDAExecutionProvider" not in providers:
        return "CPU"
    try:
        import pynvml

        pynvml.nvmlInit()
        return str(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0)))
    except Exception:  # noqa: BLE001 - a name is only a label
        return "CUDA (NVML not available)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=os.environ.get("SPILLWAY_MODELS_DIR", "models"))
    parser.add_argument("--providers", default="CUDAExecutionProvider,CPUExecutionProvider")
    parser.add_argument("--seconds", type=float, default=8.0, help="per load point")
    parser.add_argument("--quick", action="store_true", help="a small CNN, short points")
    parser.add_argument("--out", default=None, help="folder for bench-gpu.md")
    args = parser.parse_args(argv)
    providers = args.providers.split(",")
    if (
        providers[0] == "CUDAExecutionProvider"
        and providers[0] not in ort.get_available_providers()
    ):
        sys.exit(f"ONNX Runtime has no CUDA here: {ort.get_available_providers()}")
    seconds = min(args.seconds, 0.5) if args.quick else args.seconds
    with tempfile.TemporaryDirectory(prefix="spillway-gpu-bench-") as tmp:
        work = Path(tmp)
        models = build_repository(Path(args.models).resolve(), work / "repo", args.quick)
        rows = measure_service(work / "repo", work / "logs", providers, models, seconds)
        for model in models:
            raw(model, providers, min(seconds, 2.0), rows[model.name])
    text = report(list(rows.values()), providers, device_name(providers))
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench-gpu.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
