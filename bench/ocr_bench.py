"""OCR pages/s and latency: the GPU service's ``ocr`` pipeline against RapidOCR's own loop
in one process on the same pages, and what batching across requests gains on
recognition, all measured in one run.

* **Pages**: 16 PNG pages rendered with Pillow's built-in font (1 to 4 lines of English,
  16 to 32 px, 736 px a side: the detector's own scale, so no page is resized up),
  the same on every run (``pages``).
* **RapidOCR**: ``RapidOCR()`` (the pinned 1.4.4 wheel: the same ONNX files, its own pre-
  and post-processing, ONNX Runtime with its default threads) called on each page's
  bytes in turn, after one warm-up pass over four pages: the in-process limit.
* **Service**: ``python -m gpu_service`` on 127.0.0.1 with the OCR models built from the
  wheel into a fresh repository, ``ocr`` driven by ``bench.loadgen`` at each
  concurrency with a fixed number of requests (the pages in turn); the recogniser's runs
  read from ``/v2/models/ocr-rec/stats`` before and after each point.
* **Batching off**: a second service, up at the same time, whose ``ocr-rec`` takes one
  crop a run (``max_batch_size`` 1: no batching on recognition, neither a page's lines
  nor across requests), driven right after the first at each concurrency above 1, so
  drift on a shared machine falls on both alike.
* RapidOCR's loop runs before and after the services; the faster pass counts (on a
  shared machine, noise only ever slows a run down).

Writes the table to stdout and, with ``--out``, to that file. ``--quick`` runs two pages
at concurrency 1 and 2 (the test of this script, ``tests/integration/test_ocr_bench.py``).

    .venv/bin/python -m bench.ocr_bench [--requests 16,32,64] [--out docs/bench-ocr.md]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from bench.loadgen import LoadResult, http_request, run_load
from bench.serving_bench import load_average, start_service
from spillway.protocol.codec import encode_request
from spillway_cli.local import procs
from spillway_cli.modelbuild.build import build_repository
from spillway_cli.modelbuild.ocr import render_lines

MODELS = ["ocr-det", "ocr-cls", "ocr-rec", "ocr-lines", "ocr"]
CONCURRENCIES = (1, 8, 32)
REQUESTS = (16, 32, 64)
SIDE = 736
"""Pixels a page side: RapidOCR's detector scales a page's shorter side to 736."""
SIZES = (16, 20, 24, 32)
WORDS = (
    "invoice total due by friday please review the order shipped today "
    "refund requests take five business days our team moved a new model "
    "to production weather cold windy weekend small cat sat on warm mat"
)
LABELS = {"on": "service", "off": "service, ocr-rec one crop a run"}
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
    rec: RecRuns | None = None


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


def bench_repository(dest: Path, batching: bool) -> None:
    """The OCR models built from the wheel; without ``batching``, ``ocr-rec`` takes one
    crop a run (``max_batch_size`` 1): one row a run, whatever the client sends."""
    build_repository(dest, MODELS)
    if not batching:
        path = dest / "ocr-rec" / "config.json"
        config = json.loads(path.read_text())
        config["max_batch_size"] = 1
        path.write_text(json.dumps(config, indent=2))


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
    prepared = []
    for image in images:
        body, length = encode_request(
            {"image": np.array([image], dtype=np.object_)}, binary=True, binary_outputs=True
        )
        prepared.append(
            http_request("/v2/models/ocr/infer", body, length, "application/octet-stream")
        )
    return prepared


@contextmanager
def service(repo: Path, logs: Path, mode: str) -> Iterator[tuple[str, int]]:
    """The GPU service on ``repo``, ready and warm: its base URL and port."""
    child, port = start_service(f"ocr-{mode}", repo, logs, ["CPUExecutionProvider"], SETTINGS)
    base = f"http://127.0.0.1:{port}"
    try:
        procs.wait_http(f"{base}/v2/health/ready", 180, child.proc)
        yield base, port
    finally:
        child.stop()


def drive(base: str, port: int, label: str, batch: list[bytes], concurrency: int) -> Point:
    """One bounded load on one service, with the recogniser's runs during it."""
    before = rec_runs(base)
    (result,) = run_load(port, batch, concurrency)
    return served(label, concurrency, result, rec_runs(base).since(before))


def measure_services(work: Path, images: list[bytes], loads: list[tuple[int, int]]) -> list[Point]:
    """Both services up at once, driven in turn at each load (one crop a run only above
    concurrency 1), so the machine's drift falls on both alike."""
    prepared = requests_for(images)
    points = []
    with ExitStack() as stack:
        running = {}
        for mode in LABELS:
            bench_repository(work / mode, batching=mode == "on")
            running[mode] = stack.enter_context(service(work / mode, work / "logs", mode))
            run_load(running[mode][1], prepared[:1], 1)  # warm-up
        for concurrency, count in loads:
            batch = [prepared[i % len(prepared)] for i in range(count)]
            for mode, (base, port) in running.items():
                if mode == "on" or concurrency > 1:
                    points.append(drive(base, port, LABELS[mode], batch, concurrency))
    return points


def served(label: str, concurrency: int, result: LoadResult, rec: RecRuns) -> Point:
    """A service point: pages/s counts only the answers that were 200."""
    point = summarise(label, concurrency, result.latencies, result.wall_s)
    errors = len(result.latencies) - result.ok
    return replace(point, pages_per_s=result.ok / result.wall_s, errors=errors, rec=rec)


# -- the report ----------------------------------------------------------------------------


def report(raw: Point, points: list[Point], load: list[str], pages_: int) -> str:
    """The table: every point, pages/s against RapidOCR's loop, the recogniser's runs,
    and batching on against off at each concurrency both ran."""
    lines = [
        f"{pages_} pages, CPUExecutionProvider, load average {' -> '.join(load)} "
        f"(1/5/15 min, before -> after).",
        "",
        "| server | concurrency | requests | pages/s | ÷ RapidOCR loop | p50 ms | p99 ms "
        "| errors | ocr-rec rows/run | ocr-rec compute ms/row |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for point in [raw, *points]:
        rec = point.rec
        lines.append(
            f"| {point.label} | {point.concurrency} | {point.requests} "
            f"| {point.pages_per_s:.2f} | {point.pages_per_s / raw.pages_per_s:.2f} "
            f"| {point.p50_ms:,.0f} | {point.p99_ms:,.0f} | {point.errors} "
            f"| {f'{rec.rows_per_run:.2f}' if rec else '—'} "
            f"| {f'{rec.ms_per_row:.1f}' if rec else '—'} |"
        )
    return "\n".join([*lines, "", *gains(points)])


def gains(points: list[Point]) -> list[str]:
    """Batching on ÷ off at each concurrency both ran: pages/s and recogniser ms/row."""
    on = {p.concurrency: p for p in points if p.label == LABELS["on"]}
    out = []
    for off in (p for p in points if p.label == LABELS["off"] and p.concurrency in on):
        with_ = on[off.concurrency]
        per_row = (
            off.rec.ms_per_row / with_.rec.ms_per_row
            if off.rec and with_.rec and with_.rec.ms_per_row
            else float("nan")
        )
        out.append(
            f"* c{off.concurrency}: batching on ÷ off: pages/s "
            f"{with_.pages_per_s / off.pages_per_s:.2f}, ocr-rec compute per row "
            f"{per_row:.2f}× less"
        )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--requests",
        default=",".join(map(str, REQUESTS)),
        help="requests at concurrency 1, 8 and 32",
    )
    parser.add_argument("--quick", action="store_true", help="2 pages, concurrency 1 and 2")
    parser.add_argument("--out", default=None, help="file for the table")
    args = parser.parse_args(argv)
    if args.quick:
        images, loads = pages(2), [(1, 2), (2, 2)]
    else:
        counts = [int(n) for n in args.requests.split(",")]
        images, loads = pages(), list(zip(CONCURRENCIES, counts, strict=True))
    load = [load_average()]
    first = rapidocr_loop(images)
    with tempfile.TemporaryDirectory(prefix="spillway-ocr-bench-") as tmp:
        points = measure_services(Path(tmp), images, loads)
    raw = max(first, rapidocr_loop(images), key=lambda p: p.pages_per_s)
    load.append(load_average())
    text = report(raw, points, load, len(images))
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
