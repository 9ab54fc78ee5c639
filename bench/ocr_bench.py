"""OCR pages/s and latency under one compute budget: the GPU service's ``ocr`` pipeline
against RapidOCR's own loop in one process on the same pages, and a light model's latency
while pages arrive, all measured in one run.

* **Pages**: 16 PNG pages rendered with Pillow's built-in font (1 to 4 lines of English,
  16 to 32 px, 736 px a side: the detector's own scale, so no page is resized up),
  the same on every run (``pages``).
* **RapidOCR**: ``RapidOCR()`` (the pinned 1.4.4 wheel: the same ONNX files, its own pre-
  and post-processing, ONNX Runtime with its default threads) called on each page's
  bytes in turn, after one warm-up pass over four pages: the in-process limit. It runs
  before and after the services; the faster pass counts (on a shared machine, noise only
  ever slows a run down).
* **Service**: ``python -m gpu_service`` on 127.0.0.1 with the OCR models built from the
  wheel and ``digits`` in a fresh repository, ``ocr`` driven by ``bench.loadgen`` at each
  concurrency with a fixed number of requests (the pages in turn); the recogniser's runs
  read from ``/v2/models/ocr-rec/stats`` before and after each point. **p99 ÷ queue**:
  the p99 over the time the pages ahead of one need at the measured rate
  ((concurrency - 1) ÷ pages/s): 1 is first come, first served.
* **Mixed**: ``digits`` at a steady ``--digits-rate`` (an open loop: a slow answer delays
  no later request) for 10 s alone, then for as long as 32 clients send pages.
* **Before**: with ``--before DIR`` (a checkout of another commit), a second service
  from that tree is up at the same time and driven right after the first at every
  point, so drift on a shared machine falls on both alike.

Writes the tables to stdout and, with ``--out``, to that file. ``--quick`` runs two pages
at concurrency 1 and 2 and a short mixed point (the test of this script,
``tests/integration/test_ocr_bench.py``).

    .venv/bin/python -m bench.ocr_bench [--before DIR] [--out docs/bench-ocr.md]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from bench.loadgen import LoadResult, http_request, run_load, run_steady
from bench.serving_bench import load_average
from spillway.protocol.codec import encode_request
from spillway_cli.local import procs
from spillway_cli.modelbuild.build import build_repository
from spillway_cli.modelbuild.ocr import render_lines

MODELS = ["ocr-det", "ocr-cls", "ocr-rec", "ocr-lines", "ocr", "digits"]
CONCURRENCIES = (1, 8, 32, 64)
REQUESTS = (16, 32, 64, 128)
MIXED_CONCURRENCY = 32
DIGITS_RATE = 40.0
DIGITS_ALONE_S = 10.0
SIDE = 736
"""Pixels a page side: RapidOCR's detector scales a page's shorter side to 736."""
SIZES = (16, 20, 24, 32)
WORDS = (
    "invoice total due by friday please review the order shipped today "
    "refund requests take five business days our team moved a new model "
    "to production weather cold windy weekend small cat sat on warm mat"
)
SERVICE, BEFORE = "service", "before"
SETTINGS = {"GPU_MAX_BYTES_PER_ELEMENT": str(4 * 1024 * 1024), "GPU_LOG_LEVEL": "WARNING"}


@dataclass(frozen=True)
class Point:
    """One load: pages/s and latency, and the recogniser's runs during it (service)."""

    label: str
    concurrency: int
    requests: int
    pages_per_s: float
    p50_ms: float
    p99_ms: float
    errors: int = 0
    shed: int = 0
    rec: RecRuns | None = None

    @property
    def p99_over_queue(self) -> float:
        """p99 ÷ the time the pages ahead of one need at this rate (nan at c1)."""
        ahead_s = (self.concurrency - 1) / self.pages_per_s if self.pages_per_s else 0.0
        return self.p99_ms / 1e3 / ahead_s if ahead_s else float("nan")


@dataclass(frozen=True)
class Mixed:
    """``digits`` latency at a steady rate, alone and beside 32 clients' pages."""

    label: str
    alone: LoadResult
    under: LoadResult
    pages: Point


@dataclass(frozen=True)
class RecRuns:
    """What ``ocr-rec`` computed during one load: rows (crops), runs, compute time."""

    rows: int
    runs: int
    compute_ns: int

    @property
    def rows_per_run(self) -> float:
        return self.rows / self.runs if self.runs else 0.0

    @property
    def ms_per_row(self) -> float:
        return self.compute_ns / self.rows / 1e6 if self.rows else 0.0

    def since(self, before: RecRuns) -> RecRuns:
        return RecRuns(
            self.rows - before.rows, self.runs - before.runs, self.compute_ns - before.compute_ns
        )


# -- pages -----------------------------------------------------------------------------


def pages(count: int = 16, seed: int = 26) -> list[bytes]:
    """``count`` PNG pages: page i has ``i % 4 + 1`` lines of 4 to 7 words at
    ``SIZES[i // 4 % 4]`` px; the same bytes on every call."""
    rng = np.random.default_rng(seed)
    out = []
    for index in range(count):
        lines = [
            " ".join(rng.choice(WORDS.split(), int(rng.integers(4, 8))))
            for _ in range(index % 4 + 1)
        ]
        out.append(render_lines(lines, size=SIZES[index // 4 % 4], min_side=SIDE))
    return out


def summarise(label: str, concurrency: int, latencies: list[float], wall_s: float) -> Point:
    """Pages/s over the wall time, p50 and p99 of the latencies (seconds in, ms out)."""
    return Point(
        label,
        concurrency,
        len(latencies),
        len(latencies) / wall_s,
        float(np.percentile(latencies, 50)) * 1e3,
        float(np.percentile(latencies, 99)) * 1e3,
    )


# -- RapidOCR's own loop ------------------------------------------------------------------


def rapidocr_loop(images: list[bytes]) -> Point:
    """Each page through ``RapidOCR()`` in turn, in this process, after a warm-up."""
    from rapidocr_onnxruntime import RapidOCR

    engine = RapidOCR()
    for image in images[:4]:
        engine(image)
    latencies = []
    started = time.perf_counter()
    for image in images:
        begun = time.perf_counter()
        engine(image)
        latencies.append(time.perf_counter() - begun)
    return summarise("RapidOCR() loop, 1 process", 1, latencies, time.perf_counter() - started)


# -- the service ---------------------------------------------------------------------------


def rec_runs(base: str) -> RecRuns:
    """``ocr-rec``'s rows, runs and compute time so far, from the service's statistics."""
    with urllib.request.urlopen(f"{base}/v2/models/ocr-rec/stats", timeout=30) as r:  # noqa: S310
        entry = json.loads(r.read())["model_stats"][0]
    sizes = entry["batch_stats"]
    return RecRuns(
        sum(b["batch_size"] * b["compute_infer"]["count"] for b in sizes),
        sum(b["compute_infer"]["count"] for b in sizes),
        sum(b["compute_infer"]["ns"] for b in sizes),
    )


def requests_for(images: list[bytes]) -> list[bytes]:
    """One prepared ``ocr`` request a page (binary image in, binary outputs)."""
    return [
        binary_request("ocr", {"image": np.array([image], dtype=np.object_)}) for image in images
    ]


def binary_request(model: str, inputs: dict[str, np.ndarray]) -> bytes:
    body, length = encode_request(inputs, binary=True, binary_outputs=True)
    return http_request(f"/v2/models/{model}/infer", body, length, "application/octet-stream")


DIGITS = binary_request(
    "digits", {"image": np.linspace(0, 16, 64, dtype=np.float32).reshape(1, 8, 8)}
)


@contextmanager
def service(repo: Path, logs: Path, label: str, tree: Path | None) -> Iterator[tuple[str, int]]:
    """The GPU service on ``repo`` (from ``tree``, a checkout, when given), ready and
    warm: its base URL and port."""
    port = procs.free_port()
    env = {
        "GPU_REPOSITORY": str(repo),
        "GPU_PORT": str(port),
        "GPU_PROVIDERS": json.dumps(["CPUExecutionProvider"]),
        **SETTINGS,
    }
    argv = [sys.executable, "-m", "gpu_service"]
    if tree is not None:  # that tree's packages first, whatever the working directory
        run = "import runpy,sys;sys.path.insert(0,sys.argv.pop(1));"
        run += "runpy.run_module('gpu_service',run_name='__main__')"
        argv = [sys.executable, "-c", run, str(tree)]
    child = procs.start(f"ocr-{label}", argv, logs, env)
    base = f"http://127.0.0.1:{port}"
    try:
        procs.wait_http(f"{base}/v2/health/ready", 180, child.proc)
        run_load(port, [DIGITS], 1)
        yield base, port
    finally:
        child.stop()


def build_with(tree: Path | None, dest: Path) -> None:
    """The repository built by ``tree``'s own code (a checkout's configs are what its
    service reads), else by this one's."""
    if tree is None:
        build_repository(dest, MODELS)
        return
    code = "import sys;sys.path.insert(0,sys.argv[1]);from pathlib import Path;"
    code += "from spillway_cli.modelbuild.build import build_repository as b;"
    code += "b(Path(sys.argv[2]),sys.argv[3].split(','))"
    subprocess.run([sys.executable, "-c", code, str(tree), str(dest), ",".join(MODELS)], check=True)


def drive(base: str, port: int, label: str, batch: list[bytes], concurrency: int) -> Point:
    """One bounded load on one service, with the recogniser's runs during it."""
    before = rec_runs(base)
    (result,) = run_load(port, batch, concurrency)
    return served(label, concurrency, result, rec_runs(base).since(before))


def mixed(
    base: str, port: int, label: str, batch: list[bytes], rate: float, alone_s: float
) -> Mixed:
    """``digits`` at ``rate`` alone for ``alone_s``, then beside 32 clients' pages."""
    alone, _ = run_steady(port, DIGITS, rate, seconds=alone_s)
    before = rec_runs(base)
    under, pages_ = run_steady(port, DIGITS, rate, beside=(batch, MIXED_CONCURRENCY))
    assert pages_ is not None
    point = served(label, MIXED_CONCURRENCY, pages_, rec_runs(base).since(before))
    return Mixed(label, alone, under, point)


def measure_services(
    work: Path,
    images: list[bytes],
    loads: list[tuple[int, int]],
    trees: dict[str, Path | None],
    mixed_load: tuple[int, float, float],
) -> tuple[list[Point], list[Mixed]]:
    """Every service up at once, driven in turn at each load and then mixed, so the
    machine's drift falls on all alike."""
    prepared = requests_for(images)
    points, mixes = [], []
    for label, tree in trees.items():
        build_with(tree, work / label)
    with ExitStack() as stack:
        running = {
            label: stack.enter_context(service(work / label, work / "logs", label, tree))
            for label, tree in trees.items()
        }
        for _, port in running.values():
            run_load(port, prepared[:1], 1)  # warm-up
        for concurrency, count in loads:
            batch = [prepared[i % len(prepared)] for i in range(count)]
            for label, (base, port) in running.items():
                points.append(drive(base, port, label, batch, concurrency))
        count, rate, alone_s = mixed_load
        batch = [prepared[i % len(prepared)] for i in range(count)]
        for label, (base, port) in running.items():
            mixes.append(mixed(base, port, label, batch, rate, alone_s))
    return points, mixes


def served(label: str, concurrency: int, result: LoadResult, rec: RecRuns) -> Point:
    """A service point: pages/s counts only the answers that were 200."""
    point = summarise(label, concurrency, result.latencies, result.wall_s)
    errors = len(result.latencies) - result.ok
    return replace(
        point,
        pages_per_s=result.ok / result.wall_s,
        errors=errors,
        shed=result.statuses.get(429, 0),
        rec=rec,
    )


# -- the report ----------------------------------------------------------------------------


def report(
    raw: Point, points: list[Point], mixes: list[Mixed], load: list[str], pages_: int
) -> str:
    """The tables: every OCR point against RapidOCR's loop and its own c1 rate, with the
    recogniser's runs; then ``digits`` alone and under pages."""
    lines = [
        f"{pages_} pages, CPUExecutionProvider, load average {' -> '.join(load)} "
        f"(1/5/15 min, before -> after).",
        "",
        "| server | concurrency | requests | pages/s | ÷ RapidOCR loop | ÷ own c1 | p50 ms "
        "| p99 ms | p99 ÷ queue | errors (429) | ocr-rec rows/run | ocr-rec compute ms/row |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    c1 = {p.label: p.pages_per_s for p in points if p.concurrency == 1}
    for point in [raw, *points]:
        rec = point.rec
        own = c1.get(point.label)
        lines.append(
            f"| {point.label} | {point.concurrency} | {point.requests} "
            f"| {point.pages_per_s:.2f} | {point.pages_per_s / raw.pages_per_s:.2f} "
            f"| {f'{point.pages_per_s / own:.2f}' if own else '—'} "
            f"| {point.p50_ms:,.0f} | {point.p99_ms:,.0f} "
            f"| {_ratio(point.p99_over_queue)} | {point.errors} ({point.shed}) "
            f"| {f'{rec.rows_per_run:.2f}' if rec else '—'} "
            f"| {f'{rec.ms_per_row:.1f}' if rec else '—'} |"
        )
    lines += [
        "",
        f"digits at a steady rate, alone and while {MIXED_CONCURRENCY} clients send pages:",
        "",
        "| server | digits | requests | p50 ms | p99 ms | p99 ÷ alone | errors | pages/s beside |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mix in mixes:
        alone_p99 = mix.alone.percentile(99)
        for name, result in (("alone", mix.alone), ("under pages", mix.under)):
            errors = len(result.latencies) - result.ok
            pages_s = f"{mix.pages.pages_per_s:.2f}" if result is mix.under else "—"
            lines.append(
                f"| {mix.label} | {name} | {len(result.latencies)} "
                f"| {result.percentile(50) * 1e3:.1f} | {result.percentile(99) * 1e3:.1f} "
                f"| {result.percentile(99) / alone_p99:.2f} | {errors} | {pages_s} |"
            )
    return "\n".join(lines)


def _ratio(value: float) -> str:
    return "—" if value != value else f"{value:.2f}"  # nan: no pages ahead at c1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--requests",
        default=",".join(map(str, REQUESTS)),
        help="requests at concurrency 1, 8, 32 and 64",
    )
    parser.add_argument("--digits-rate", type=float, default=DIGITS_RATE, help="digits/s")
    parser.add_argument("--before", type=Path, default=None, help="a checkout to compare")
    parser.add_argument("--quick", action="store_true", help="2 pages, concurrency 1 and 2")
    parser.add_argument("--out", default=None, help="file for the tables")
    args = parser.parse_args(argv)
    trees: dict[str, Path | None] = {SERVICE: None}
    if args.before is not None:
        trees[BEFORE] = args.before.resolve()
    if args.quick:
        images, loads = pages(2), [(1, 2), (2, 2)]
        mixed_load = (4, 20.0, 1.0)
    else:
        counts = [int(n) for n in args.requests.split(",")]
        images, loads = pages(), list(zip(CONCURRENCIES, counts, strict=True))
        mixed_load = (counts[2], args.digits_rate, DIGITS_ALONE_S)
    load = [load_average()]
    first = rapidocr_loop(images)
    with tempfile.TemporaryDirectory(prefix="spillway-ocr-bench-") as tmp:
        points, mixes = measure_services(Path(tmp), images, loads, trees, mixed_load)
    raw = max(first, rapidocr_loop(images), key=lambda p: p.pages_per_s)
    load.append(load_average())
    text = report(raw, points, mixes, load, len(images))
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
