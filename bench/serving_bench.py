"""GPU service throughput and latency against raw ONNX Runtime and Python's HTTP floor,
every ratio measured in one run.

Builds a benchmark repository with the same batching knobs for every model (max batch
32, 5 ms queue delay): mlp-bench (binary tensors), minilm (text, tokenised by the
service) and ``minilm-ids`` (the same graph fed pre-tokenised ids, so tokenising is out of
the comparison). Starts the HTTP floor app (``bench.http_floor``) and the service on
127.0.0.1, drives each with wrk at fixed concurrencies for a fixed time, reads the batch
sizes the service formed from its statistics, and times the same graphs directly in
ONNX Runtime (all cores) at batch 1 and 32. Writes ``docs/bench-serving.md`` and
``docs/bench-serving.png``.

``--layouts`` repeats the service points for several thread layouts (intra-op threads x
compute slots, ``auto`` being the service's default), which is how the default was chosen;
a layout ending in ``/uvicorn`` runs the same app under uvicorn instead of the service's
own HTTP server, so both are measured in one run.

    .venv/bin/python -m bench.serving_bench [--seconds 10] [--repeats 3]
        [--layouts auto,1x2,2x1,auto/uvicorn] [--providers CUDAExecutionProvider]

Each point is the best of ``--repeats`` rounds (the service stays up between rounds), as
is each raw figure: on a shared machine, noise only ever slows a run down.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from bench import serving_report, wrk
from bench.serving_report import Point, Raw, Run
from spillway.models.repository import sha256_file
from spillway.protocol.codec import encode_request
from spillway_cli.local import procs

ROOT = Path(__file__).resolve().parent.parent
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
MAX_BATCH = 32
DELAY_US = 5000
TOKENS = 16
"""Tokens of every benchmark text ([CLS] and [SEP] included), so text and pre-tokenised
requests run the very same graph work, in the first length bucket of minilm (whose compute
threads run at normal OS priority, as the pre-tokenised model's do)."""
CONCURRENCIES = (1, 8, 64)
Feeds = dict[str, np.ndarray]


def texts(count: int, low: int, high: int, seed: int) -> list[str]:
    """Sentences whose token counts lie between ``low`` and ``high``."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(rng.integers(low - 2, high - 2)))) for _ in range(count)]


# -- the benchmark repository ------------------------------------------------------------


def bench_repository(models: Path, dest: Path) -> None:
    """mlp-bench, minilm and minilm-ids with the same batching knobs; model files linked."""
    for name in ("mlp-bench", "minilm"):
        config = json.loads((models / name / "config.json").read_text())
        _knobs(config)
        _link_version(models / name / "1", dest / name / "1")
        (dest / name / "config.json").write_text(json.dumps(config))
    ids = json.loads((models / "minilm" / "config.json").read_text())
    _knobs(ids)
    ids["name"] = "minilm-ids"
    ids["input"] = [
        {"name": n, "data_type": "TYPE_INT64", "dims": [-1]}
        for n in ("input_ids", "attention_mask")
    ]
    ids["spillway"] = {"kind": "tensor", "onnx_file": "model.onnx", "length_buckets": []}
    version = dest / "minilm-ids" / "1"
    version.mkdir(parents=True)
    (version / "model.onnx").symlink_to((models / "minilm" / "1" / "model.onnx").resolve())
    (version / "SHA256SUMS").write_text(f"{sha256_file(version / 'model.onnx')}  model.onnx\n")
    (dest / "minilm-ids" / "config.json").write_text(json.dumps(ids))


def _knobs(config: dict[str, Any]) -> None:
    config["max_batch_size"] = MAX_BATCH
    batching = config["dynamic_batching"]
    batching["preferred_batch_size"] = []
    batching["max_queue_delay_microseconds"] = DELAY_US


def _link_version(source: Path, dest: Path) -> None:
    dest.mkdir(parents=True)
    for path in source.iterdir():
        (dest / path.name).symlink_to(path.resolve())


# -- bodies --------------------------------------------------------------------------------


def exact_text(tokenizer: Tokenizer, tokens: int, seed: int) -> str:
    """A sentence of exactly ``tokens`` tokens (one-token words only)."""
    single = [w for w in WORDS if len(tokenizer.encode(w).ids) == 3]
    rng = np.random.default_rng(seed)
    text = " ".join(rng.choice(single, tokens - 2))
    assert len(tokenizer.encode(text).ids) == tokens
    return text


def bodies(tokenizer: Tokenizer) -> dict[str, wrk.Body]:
    """One request body per scenario; outputs come back as binary data in each."""
    rng = np.random.default_rng(1)
    binary = "application/octet-stream"

    def tensors(inputs: Feeds, as_binary: bool) -> wrk.Body:
        data, length = encode_request(inputs, binary=as_binary, binary_outputs=True)
        return wrk.Body(data, length, binary if length is not None else "application/json")

    text = exact_text(tokenizer, TOKENS, seed=3)
    ids = np.array([tokenizer.encode(text).ids], dtype=np.int64)
    short = texts(1, 10, 12, seed=7)[0]
    long = texts(1, 200, 210, seed=8)[0]
    return {
        "mlp": tensors({"input": rng.standard_normal((1, 1024), dtype=np.float32)}, True),
        "ids": tensors({"input_ids": ids, "attention_mask": np.ones_like(ids)}, True),
        "text": tensors({"text": np.array([[text.encode()]], dtype=np.object_)}, False),
        "short": tensors({"text": np.array([[short.encode()]], dtype=np.object_)}, False),
        "long": tensors({"text": np.array([[long.encode()]], dtype=np.object_)}, False),
    }


# -- raw ONNX Runtime ----------------------------------------------------------------------


def raw(path: Path, providers: list[str], feeds_for: Callable[[int], Feeds], repeats: int) -> Raw:
    """Batch-1 p50 latency, batch-32 and batch-8 rows/s, each the best of one intra-op
    thread and one per core (on a small, shared CPU either can win) over ``repeats``
    rounds."""
    best = Raw(float("inf"), 0.0)
    for threads in [*dict.fromkeys((1, os.cpu_count() or 1))] * repeats:
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        session = ort.InferenceSession(str(path), options, providers=providers)
        measured = _time_runs(session, feeds_for(1), feeds_for(MAX_BATCH))
        eight = _rows_per_s(session, feeds_for(8))
        best = Raw(
            min(best.b1_p50_ms, measured.b1_p50_ms),
            max(best.b32_rows_per_s, measured.b32_rows_per_s),
            max(best.b8_rows_per_s, eight),
        )
    return best


def _time_runs(session: ort.InferenceSession, one: Feeds, full: Feeds) -> Raw:
    for _ in range(20):
        session.run(None, one)
    times = []
    for _ in range(200):
        started = time.perf_counter()
        session.run(None, one)
        times.append(time.perf_counter() - started)
    return Raw(float(np.percentile(times, 50)) * 1e3, _rows_per_s(session, full))


def _rows_per_s(session: ort.InferenceSession, feeds: Feeds) -> float:
    """Rows/s of back-to-back runs of one batch for about 2 s."""
    session.run(None, feeds)
    rows = int(next(iter(feeds.values())).shape[0])
    runs, started = 0, time.perf_counter()
    while runs < 5 or time.perf_counter() - started < 2.0:
        session.run(None, feeds)
        runs += 1
    return runs * rows / (time.perf_counter() - started)


def raw_all(
    models: Path, providers: list[str], body_ids: np.ndarray, repeats: int
) -> dict[str, Raw]:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((MAX_BATCH, 1024), dtype=np.float32)
    ids = np.repeat(body_ids, MAX_BATCH, axis=0)

    def minilm(n: int) -> Feeds:
        return {"input_ids": ids[:n], "attention_mask": np.ones_like(ids[:n])}

    return {
        "mlp": raw(
            models / "mlp-bench/1/model.onnx", providers, lambda n: {"input": x[:n]}, repeats
        ),
        "minilm": raw(models / "minilm/1/model.onnx", providers, minilm, repeats),
    }


# -- the servers ---------------------------------------------------------------------------


def executions(base: str, model: str) -> dict[int, int]:
    """Executions per batch size so far."""
    with urllib.request.urlopen(f"{base}/v2/models/{model}/stats", timeout=10) as r:  # noqa: S310
        entry = json.loads(r.read())["model_stats"][0]
    return {b["batch_size"]: b["compute_infer"]["count"] for b in entry["batch_stats"]}


def mean_batch(before: dict[int, int], after: dict[int, int]) -> float:
    formed = {k: v - before.get(k, 0) for k, v in after.items()}
    runs = sum(formed.values())
    return sum(k * v for k, v in formed.items()) / runs if runs else 0.0


def best(results: list[wrk.WrkResult]) -> wrk.WrkResult:
    """The fastest of repeated runs: on a shared machine noise only ever slows a run."""
    return max(results, key=lambda r: r.per_s)


def measure_floor(
    logs: Path, body: wrk.Body, seconds: float, repeats: int, kind: str = "asgi"
) -> dict[int, wrk.WrkResult]:
    port = procs.free_port()
    command = [sys.executable, "-m", "bench.http_floor", str(port), kind]
    child = procs.start(f"floor-{kind}", command, logs)
    url = f"http://127.0.0.1:{port}/"
    try:
        procs.wait_http(url, 60, child.proc)
        wrk.run(url, body, 64, 1)  # warm-up
        return {c: best([wrk.run(url, body, c, seconds) for _ in range(repeats)]) for c in (1, 64)}
    finally:
        child.stop()


def layout_env(layout: str) -> dict[str, str]:
    """The service's settings for a layout: ``auto`` or ``<threads>x<slots>``, optionally
    followed by ``/uvicorn`` (the same app under uvicorn instead of the service's own
    HTTP server: the before/after of that change in one run)."""
    layout, _, server = layout.partition("/")
    env = {"GPU_HTTP_SERVER": server} if server else {}
    if layout == "auto":
        return env
    intra, slots = layout.split("x")
    return {**env, "GPU_INTRA_OP_THREADS": intra, "GPU_COMPUTE_SLOTS": slots}


def start_service(
    label: str, repo: Path, logs: Path, providers: list[str], settings: dict[str, str]
) -> tuple[procs.Child, int]:
    """``python -m gpu_service`` on a free port of 127.0.0.1 with ``GPU_*`` settings."""
    port = procs.free_port()
    env = {
        "GPU_REPOSITORY": str(repo),
        "GPU_PORT": str(port),
        "GPU_PROVIDERS": json.dumps(providers),
        "GPU_LOG_LEVEL": "WARNING",
        **settings,
    }
    return procs.start(label, [sys.executable, "-m", "gpu_service"], logs, env), port


def measure_service(
    repo: Path,
    logs: Path,
    providers: list[str],
    layout: str,
    bodies_: dict[str, wrk.Body],
    seconds: float,
    repeats: int,
) -> list[Point]:
    """Every service point for one thread layout, each the best of ``repeats`` rounds."""
    label = f"gpu-{layout.replace('/', '-')}"
    child, port = start_service(label, repo, logs, providers, layout_env(layout))
    base = f"http://127.0.0.1:{port}"
    rounds: dict[tuple[str, int], list[Point]] = {}
    try:
        procs.wait_http(f"{base}/v2/health/ready", 180, child.proc)
        for _ in range(repeats):
            for point in one_round(base, layout, bodies_, seconds):
                rounds.setdefault((point.scenario, point.concurrency), []).append(point)
    finally:
        child.stop()
    return [max(points, key=lambda p: p.rows_per_s) for points in rounds.values()]


def one_round(base: str, layout: str, bodies_: dict[str, wrk.Body], seconds: float) -> list[Point]:
    points: list[Point] = []
    for scenario, model, body in (
        ("mlp-bench binary", "mlp-bench", "mlp"),
        ("minilm pre-tokenised", "minilm-ids", "ids"),
        ("minilm text", "minilm", "text"),
    ):
        url = f"{base}/v2/models/{model}/infer"
        wrk.run(url, bodies_[body], 8, 1)  # warm-up
        for concurrency in CONCURRENCIES:
            before = executions(base, model)
            result = wrk.run(url, bodies_[body], concurrency, seconds)
            batch = mean_batch(before, executions(base, model))
            points.append(Point(scenario, concurrency, layout, result, batch))
    return points + mixed(base, bodies_, layout, seconds)


def mixed(base: str, bodies_: dict[str, wrk.Body], layout: str, seconds: float) -> list[Point]:
    """Short texts alone, then short and long texts at once (16 clients each)."""
    url = f"{base}/v2/models/minilm/infer"
    alone = wrk.run(url, bodies_["short"], 16, seconds)
    short, long = (wrk.start(url, bodies_[k], 16, seconds) for k in ("short", "long"))
    return [
        Point("minilm short-only", 16, layout, alone),
        Point("minilm mixed: short part", 16, layout, wrk.result(short)),
        Point("minilm mixed: long part", 16, layout, wrk.result(long)),
    ]


def load_average() -> str:
    """The 1, 5 and 15 minute load averages (how contended the machine was)."""
    path = Path("/proc/loadavg")
    return " ".join(path.read_text().split()[:3]) if path.exists() else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default=os.environ.get("SPILLWAY_MODELS_DIR", "models"))
    parser.add_argument("--seconds", type=float, default=10.0, help="per load point")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; the best counts")
    parser.add_argument("--layouts", default="auto", help="e.g. auto,1x2,2x1,auto/uvicorn")
    parser.add_argument("--providers", default="CPUExecutionProvider")
    parser.add_argument("--out", default=str(ROOT / "docs"))
    args = parser.parse_args()
    if not wrk.available():
        sys.exit("wrk is not installed (apt-get install wrk)")
    models = Path(args.models).resolve()
    providers = args.providers.split(",")
    work = Path(tempfile.mkdtemp(prefix="spillway-bench-"))
    repo, logs = work / "repo", work / "logs"
    bench_repository(models, repo)
    tokenizer = Tokenizer.from_file(str(models / "minilm/1/tokenizer.json"))
    tokenizer.no_padding()
    bodies_ = bodies(tokenizer)
    run = Run(providers, args.seconds, args.repeats, load=[load_average()])
    body_ids = np.array([tokenizer.encode(exact_text(tokenizer, TOKENS, 3)).ids], np.int64)
    run.raw = raw_all(models, providers, body_ids, args.repeats)
    floor_body = bodies_["mlp"]
    run.floor = measure_floor(logs, floor_body, args.seconds, args.repeats)
    run.native_floor = measure_floor(logs, floor_body, args.seconds, args.repeats, "native")
    for layout in args.layouts.split(","):
        run.points += measure_service(
            repo, logs, providers, layout, bodies_, args.seconds, args.repeats
        )
    run.load.append(load_average())
    shutil.rmtree(work, ignore_errors=True)
    print(serving_report.write(run, Path(args.out)))


if __name__ == "__main__":
    main()
