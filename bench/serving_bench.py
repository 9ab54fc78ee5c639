"""GPU service throughput and latency against raw ONNX Runtime, in one run.

Starts the service on 127.0.0.1 (CPU provider here, CUDA where present), drives it with
bounded loads at concurrency 1, 8 and 64, reads the batch sizes it formed from its
statistics, and runs the same model directly in ONNX Runtime at those batch sizes, idle
server, same process start options. Writes ``docs/benchmarks.md`` (the serving section)
and ``docs/bench-serving.png``.

    .venv/bin/python -m bench.serving_bench [--quick] [--providers CUDAExecutionProvider]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from bench.loadgen import LoadResult, http_request, run_load
from spillway.codec import encode_request
from spillway_cli import procs

ROOT = Path(__file__).resolve().parent.parent
Feeds = Callable[[int], dict[str, np.ndarray]]
WORDS = [
    "request",
    "batch",
    "model",
    "queue",
    "latency",
    "router",
    "budget",
    "tensor",
    "serving",
    "platform",
    "shard",
    "fallback",
    "policy",
    "spill",
    "cost",
    "version",
    "swap",
    "memory",
]


@dataclass
class Row:
    """One line of the results table."""

    scenario: str
    concurrency: int
    requests: int
    rows_per_s: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    mean_batch: float
    raw_rows_per_s: float
    errors: int

    @property
    def ratio(self) -> float:
        return self.rows_per_s / self.raw_rows_per_s if self.raw_rows_per_s else float("nan")


def texts(count: int, low: int, high: int, seed: int) -> list[str]:
    """Sentences whose token counts lie between ``low`` and ``high``."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(rng.integers(low - 2, high - 2)))) for _ in range(count)]


def stats(base: str, model: str) -> dict[int, int]:
    """Executions per batch size so far."""
    with urllib.request.urlopen(f"{base}/v2/models/{model}/stats", timeout=10) as r:  # noqa: S310
        entry = json.loads(r.read())["model_stats"][0]
    return {b["batch_size"]: b["compute_infer"]["count"] for b in entry["batch_stats"]}


def formed(before: dict[int, int], after: dict[int, int]) -> dict[int, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0) > 0}


def raw_rows_per_s(
    session: ort.InferenceSession, feeds_for: Feeds, sizes: dict[int, int], budget_s: float = 4.0
) -> float:
    """Rows/s of ``session.run`` at the server's batch-size mix (time per size × its count)."""
    total_rows = sum(b * n for b, n in sizes.items())
    total_time = 0.0
    per_size_budget = budget_s / max(len(sizes), 1)
    for size, count in sizes.items():
        feeds = feeds_for(size)
        session.run(None, feeds)
        runs, started = 0, time.perf_counter()
        while runs < 3 or (time.perf_counter() - started < per_size_budget and runs < 200):
            session.run(None, feeds)
            runs += 1
        total_time += (time.perf_counter() - started) / runs * count
    return total_rows / total_time if total_time else float("nan")


def text_feeds(tokenizer: Tokenizer, pool: list[str]) -> Feeds:
    def feeds(size: int) -> dict[str, np.ndarray]:
        enc = tokenizer.encode_batch([pool[i % len(pool)] for i in range(size)])
        longest = max(len(e.ids) for e in enc)
        ids = np.zeros((size, longest), np.int64)
        mask = np.zeros((size, longest), np.int64)
        for row, e in enumerate(enc):
            ids[row, : len(e.ids)] = e.ids
            mask[row, : len(e.ids)] = 1
        return {"input_ids": ids, "attention_mask": mask}

    return feeds


def measure(
    port: int,
    base: str,
    model: str,
    requests: list[bytes],
    concurrency: int,
    session: ort.InferenceSession,
    feeds_for: Feeds,
    scenario: str,
) -> Row:
    before = stats(base, model)
    result: LoadResult = run_load(port, requests, concurrency)[0]
    sizes = formed(before, stats(base, model))
    raw = raw_rows_per_s(session, feeds_for, sizes)
    return row(scenario, concurrency, len(requests), result, mean_batch(sizes), raw)


def mean_batch(sizes: dict[int, int]) -> float:
    """Mean rows per execution from executions per batch size."""
    executions = sum(sizes.values())
    return sum(b * n for b, n in sizes.items()) / executions if executions else 0.0


def row(
    scenario: str, concurrency: int, requests: int, result: LoadResult, batch: float, raw: float
) -> Row:
    """A table row from one load's result."""
    return Row(
        scenario,
        concurrency,
        requests,
        result.ok / result.wall_s,
        result.percentile(50) * 1e3,
        result.percentile(95) * 1e3,
        result.percentile(99) * 1e3,
        batch,
        raw,
        requests - result.ok,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default=os.environ.get("SPILLWAY_MODELS_DIR", "models"))
    parser.add_argument("--quick", action="store_true", help="fewer requests")
    parser.add_argument("--providers", default="CPUExecutionProvider")
    parser.add_argument("--out", default=str(ROOT / "docs"))
    args = parser.parse_args()
    scale = 0.25 if args.quick else 1.0
    models = Path(args.models)
    providers = args.providers.split(",")
    port = procs.free_port()
    base = f"http://127.0.0.1:{port}"
    env = {
        "GPU_REPOSITORY": str(models),
        "GPU_PORT": str(port),
        "GPU_PROVIDERS": json.dumps(providers),
        "GPU_LOG_LEVEL": "WARNING",
    }
    logs = Path(tempfile.mkdtemp(prefix="spillway-bench-"))
    child = procs.start("gpu", [sys.executable, "-m", "gpu_service"], logs, env)
    rows: list[Row] = []
    try:
        procs.wait_http(f"{base}/v2/health/ready", 120, child.proc)
        rows += bench_mlp(port, base, models, providers, scale)
        rows += bench_minilm(port, base, models, providers, scale)
    finally:
        child.stop()
    write_report(rows, Path(args.out), providers)


def bench_mlp(port: int, base: str, models: Path, providers: list[str], scale: float) -> list[Row]:
    session = ort.InferenceSession(str(models / "mlp-bench/1/model.onnx"), providers=providers)
    rng = np.random.default_rng(1)
    pool = rng.standard_normal((64, 1024)).astype(np.float32)

    def request(i: int) -> bytes:
        body, length = encode_request(
            {"input": pool[i % 64 : i % 64 + 1]}, binary=True, binary_outputs=True
        )
        return http_request("/v2/models/mlp-bench/infer", body, length, "application/octet-stream")

    def feeds(size: int) -> dict[str, np.ndarray]:
        return {"input": np.resize(pool, (size, 1024))}

    out = []
    for concurrency, count in ((1, 400), (8, 3000), (64, 6000)):
        reqs = [request(i) for i in range(int(count * scale))]
        out.append(
            measure(
                port, base, "mlp-bench", reqs, concurrency, session, feeds, "mlp-bench (binary)"
            )
        )
    return out


def bench_minilm(
    port: int, base: str, models: Path, providers: list[str], scale: float
) -> list[Row]:
    session = ort.InferenceSession(str(models / "minilm/1/model.onnx"), providers=providers)
    tokenizer = Tokenizer.from_file(str(models / "minilm/1/tokenizer.json"))
    tokenizer.no_padding()

    def requests(pool: list[str]) -> list[bytes]:
        return [
            http_request(
                "/v2/models/minilm/infer",
                encode_request({"text": np.array([[t.encode()]], dtype=np.object_)}, binary=False)[
                    0
                ],
            )
            for t in pool
        ]

    out = []
    for concurrency, count in ((1, 150), (8, 1200), (64, 3000)):
        pool = texts(int(count * scale), 8, 64, seed=concurrency)
        out.append(
            measure(
                port,
                base,
                "minilm",
                requests(pool),
                concurrency,
                session,
                text_feeds(tokenizer, pool),
                "minilm (8-64 tokens)",
            )
        )
    short = texts(int(1200 * scale), 8, 16, seed=7)
    long = texts(int(400 * scale), 180, 250, seed=8)
    only = measure(
        port,
        base,
        "minilm",
        requests(short),
        16,
        session,
        text_feeds(tokenizer, short),
        "minilm short-only",
    )
    before = stats(base, "minilm")
    short_res, long_res = run_load(
        port, [], 0, groups=[(requests(short), 16), (requests(long), 16)]
    )
    batch = mean_batch(formed(before, stats(base, "minilm")))
    nan = float("nan")
    mixed = row("minilm mixed: short part", 16, len(short), short_res, batch, nan)
    mixed_long = row("minilm mixed: long part", 16, len(long), long_res, batch, nan)
    return [*out, only, mixed, mixed_long]


def write_report(rows: list[Row], out: Path, providers: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    header = (
        "| scenario | conc. | requests | rows/s | p50 ms | p95 ms | p99 ms | mean batch "
        "| raw ORT rows/s | ratio | errors |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [header]
    for r in rows:
        lines.append(
            f"| {r.scenario} | {r.concurrency} | {r.requests} | {r.rows_per_s:.0f} | "
            f"{r.p50_ms:.2f} | {r.p95_ms:.2f} | {r.p99_ms:.2f} | {r.mean_batch:.1f} | "
            f"{r.raw_rows_per_s:.0f} | {r.ratio:.2f} | {r.errors} |"
        )
    table = "\n".join(lines)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    (out / "bench-serving.md").write_text(
        f"Run {stamp}, providers {','.join(providers)}, {os.cpu_count()} CPUs.\n\n{table}\n"
    )
    plot(rows, out / "bench-serving.png")
    print(table)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for scenario in dict.fromkeys(r.scenario for r in rows):
        pts = [r for r in rows if r.scenario == scenario]
        ax.plot([r.rows_per_s for r in pts], [r.p50_ms for r in pts], "o-", label=scenario)
        for r in pts:
            ax.annotate(f"c={r.concurrency}", (r.rows_per_s, r.p50_ms), fontsize=7)
    ax.set_xlabel("throughput (rows/s)")
    ax.set_ylabel("p50 latency (ms)")
    ax.set_yscale("log")
    ax.set_title("Spillway GPU service: latency vs throughput")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
