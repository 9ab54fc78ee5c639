"""One tenant's OCR fan-out against another tenant's pages: what the fan-out cap and the
batchers' fair share keep for the second tenant.

* **Service**: the GPU service's data plane in this process (CPU provider), the OCR models
  linked from the built repository, ``ocr-det`` and ``ocr`` configured as the build writes
  them, except (to measure what each rule does) the mapped steps' ``max_rows``
  (``--max-rows``), the pipeline's ``timeout_s`` (``--pipeline-timeout-s``), ``ocr-det``'s
  length buckets (``--no-det-buckets``) and the batchers' fair share (``--no-fair-share``):
  all four off is the code before them.
* **globex**: one client reading ordinary two-line pages one after another, each with a
  ``--timeout-s`` deadline (as the router sends one): its latency (p50, p99) and 504s.
* **acme**: ``--bombs`` clients each sending, over and over until globex is done, either
  the bomb (a 2000 x 2000 page of 3,500 tiny random words: detection cuts it into
  hundreds of crops) or, with ``--heavy``, a dense page that the cap allows (a
  two-column page of 200 lines).
* **Bomb alone**: first, one bomb with nothing else running: its crops (rows orientation
  computed for it, or the ones refused) and the compute seconds of every step's batches.

Prints one JSON line per scenario (``alone``, ``with acme``).

    .venv/bin/python -m bench.fanout_bench [--max-rows 100000] [--no-fair-share] [--heavy]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from gpu_service.dataplane import DataPlane
from gpu_service.registry import ModelRegistry
from gpu_service.settings import GpuSettings
from spillway.models.config import ModelConfig
from spillway.models.repository import LocalRepository
from spillway.protocol.codec import encode_request
from spillway.protocol.errors import SpillwayError
from spillway.state.table import scope
from spillway_cli.modelbuild.common import write_checksums, write_config
from spillway_cli.modelbuild.ocr import DET, render_lines
from spillway_cli.modelbuild.ocr_pipelines import MAX_LINES, PAGE_TIMEOUT_S, ocr_config

STEPS = ("ocr-det", "ocr-cls", "ocr-rec", "ocr-lines")
ACME, GLOBEX = scope("acme"), scope("globex")
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "spillway")


def bomb_page(side: int = 2000, columns: int = 50, rows: int = 70, seed: int = 0) -> bytes:
    """The issue's bomb: tiny random words on a big page (PNG)."""
    rng = random.Random(seed)
    image = Image.new("L", (side, side), 255)
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=12)
    for row in range(rows):
        for column in range(columns):
            word = "".join(rng.choice("abcdefghkmnopqrstuvwxyz") for _ in range(3))
            draw.text((column * side // columns + 2, row * side // rows + 2), word, font=font)
    return _png(image)


def dense_page(lines: int = 100, columns: int = 2, seed: int = 1) -> bytes:
    """An A4 page at 150 dpi, ``columns`` columns of ``lines`` lines of words."""
    rng = random.Random(seed)
    width, height = 1240, 1754
    image = Image.new("L", (width, height), 255)
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=12)
    column_width, step = (width - 80) // columns, (height - 80) // lines
    for column in range(columns):
        for row in range(lines):
            text = ""
            while font.getlength(text + " word") < column_width - 30:
                text += " " + rng.choice(WORDS)
            draw.text((40 + column * column_width, 40 + row * step), text.strip(), font=font)
    return _png(image)


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


PAGE = render_lines(["invoice total due by friday", "please review the order"], 24, min_side=720)


def det_config(buckets: bool) -> ModelConfig:
    """``ocr-det`` as the build writes it, with or without its length buckets."""
    document: dict[str, Any] = DET.config.to_json_dict()
    if not buckets:
        document["spillway"]["length_buckets"] = []
    return ModelConfig.model_validate(document)


def read_config(models: Path, name: str) -> ModelConfig:
    return LocalRepository(models).read_config(name)


def build(root: Path, models: Path, args: argparse.Namespace) -> None:
    """The OCR models linked from ``models`` (``ocr-det`` with or without its length
    buckets); ``ocr`` with ``args.max_rows`` per mapped step and its ``timeout_s``."""
    buckets = args.det_buckets
    for name in STEPS:
        target = root / name
        target.mkdir()
        for path in (models / name).rglob("*"):
            dest = target / path.relative_to(models / name)
            if path.is_dir():
                dest.mkdir(exist_ok=True)
            elif path.name != "config.json":
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.link(path, dest)
        write_config(target, det_config(buckets) if name == DET.name else read_config(models, name))
    document: dict[str, Any] = ocr_config().to_json_dict()
    for step in document["ensemble_scheduling"]["step"]:
        if step.get("spillway", {}).get("map"):
            step["spillway"]["map"]["max_rows"] = args.max_rows
    document["ensemble_scheduling"]["spillway"]["timeout_s"] = args.pipeline_timeout_s
    (root / "ocr" / "1").mkdir(parents=True)
    write_checksums(root / "ocr" / "1")
    write_config(root / "ocr", ModelConfig.model_validate(document))


def body(image: bytes, timeout_s: float | None = None) -> tuple[bytes, int | None]:
    parameters = None if timeout_s is None else {"timeout": int(timeout_s * 1e6)}
    return encode_request(
        {"image": np.array([image], dtype=np.object_)},
        binary=True,
        binary_outputs=True,
        parameters=parameters,
    )


def counters(registry: ModelRegistry) -> tuple[int, float]:
    """Rows orientation computed, and seconds every step model's batches ran."""
    seconds = 0.0
    for name in STEPS:
        stats: dict[str, Any] = registry.get(name).triton_stats()
        seconds += sum(b["compute_infer"]["ns"] for b in stats["batch_stats"]) / 1e9
    rows = registry.get("ocr-cls").stats.inference_count
    return rows, seconds


async def one(plane: DataPlane, image: bytes, tenant: str, timeout_s: float | None) -> str:
    try:
        await plane.infer("ocr", None, *body(image, timeout_s), stored_scope=tenant)
    except SpillwayError as error:
        return error.code
    return "ok"


async def scenario(
    plane: DataPlane, args: argparse.Namespace, acme_page: bytes | None
) -> dict[str, Any]:
    done = asyncio.Event()
    acme: list[str] = []

    async def flood() -> None:
        while not done.is_set():
            assert acme_page is not None
            acme.append(await one(plane, acme_page, ACME, None))

    floods = [asyncio.ensure_future(flood()) for _ in range(args.bombs if acme_page else 0)]
    if floods:
        await asyncio.sleep(1.0)  # acme's work under way before globex's first page
    latencies, outcomes = [], []
    for _ in range(args.pages):
        started = time.perf_counter()
        outcomes.append(await one(plane, PAGE, GLOBEX, args.timeout_s))
        latencies.append(time.perf_counter() - started)
    done.set()
    for task in floods:  # acme goes away, as a client that disconnects: its work is dropped
        task.cancel()
    await asyncio.gather(*floods, return_exceptions=True)
    latencies.sort()
    return {
        "globex_p50_s": round(statistics.median(latencies), 3),
        "globex_p99_s": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3),
        "globex_ok": outcomes.count("ok"),
        "globex_504": outcomes.count("deadline_exceeded"),
        "acme_answers": {code: acme.count(code) for code in sorted(set(acme))},
    }


async def alone(plane: DataPlane, registry: ModelRegistry, page: bytes) -> dict[str, Any]:
    """One acme page with nothing else running: its answer, crops and compute."""
    rows, seconds = counters(registry)
    started = time.perf_counter()
    code = await one(plane, page, ACME, None)
    rows_after, seconds_after = counters(registry)
    return {
        "answer": code,
        "crops_computed": rows_after - rows,
        "compute_s": round(seconds_after - seconds, 2),
        "wall_s": round(time.perf_counter() - started, 2),
    }


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp), args.models, args)
        settings = GpuSettings(providers=("CPUExecutionProvider",), fair_share=args.fair_share)
        registry = ModelRegistry(LocalRepository(Path(tmp)), settings)
        await registry.start()
        plane = DataPlane(registry, settings)
        try:
            acme_page = dense_page() if args.heavy else bomb_page()
            setup = {"max_rows": args.max_rows, "fair_share": args.fair_share}
            setup |= {"det_buckets": args.det_buckets, "timeout_s": args.pipeline_timeout_s}
            setup |= {"acme_page": "heavy" if args.heavy else "bomb", "cpus": os.cpu_count()}
            print(json.dumps({"setup": setup}), flush=True)
            if args.acme_alone:
                print(json.dumps({"acme_page_alone": await alone(plane, registry, acme_page)}))
            for name, page in (("alone", None), ("with acme", acme_page)):
                result = await scenario(plane, args, page)
                print(json.dumps({"scenario": name, **result}), flush=True)
        finally:
            await registry.stop(5)
            plane.close()


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=Path("models"))
    parser.add_argument("--max-rows", type=int, default=MAX_LINES)
    parser.add_argument("--fair-share", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--pipeline-timeout-s", type=float, default=PAGE_TIMEOUT_S)
    parser.add_argument("--det-buckets", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--acme-alone", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--heavy", action="store_true", help="acme sends allowed dense pages")
    parser.add_argument("--bombs", type=int, default=2, help="acme's clients")
    parser.add_argument("--pages", type=int, default=12, help="globex's pages")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="globex's deadline")
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse()))
