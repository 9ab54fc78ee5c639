"""A request's work is bounded: the OCR bomb on the GPU service and the CPU fallback.

GIVEN the PP-OCR models and the ``ocr`` pipeline as the build writes it (its mapped steps
allow 256 crops a page), served by the GPU service's data plane in-process and by the
CPU fallback
WHEN acme sends a generated page of 600 tiny words (1,200 marks: 600 crops) while
globex sends an ordinary two-line page
THEN acme's page is refused, 413 ``fanout_too_large`` naming the step, its rows and the
limit, before a crop reaches orientation or recognition; globex's page is read right;
and a page whose deadline passes during detection stops there (504, nothing after it).
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from gpu_service.dataplane import DataPlane
from gpu_service.registry import ModelRegistry
from gpu_service.served import InferResult
from gpu_service.settings import GpuSettings
from spillway.fallback.service import CpuService
from spillway.fallback.settings import CpuSettings
from spillway.models.processing import Tensors
from spillway.models.repository import LocalRepository
from spillway.protocol.codec import decode_response, encode_request
from spillway.protocol.errors import SpillwayError
from spillway.state.table import scope
from spillway_cli.modelbuild.ocr import render_lines
from spillway_cli.modelbuild.ocr_pipelines import MAX_LINES, build_ocr_pipeline
from tests.support import link_model

STEPS = ["ocr-det", "ocr-cls", "ocr-rec", "ocr-lines"]
ACME, GLOBEX = scope("acme"), scope("globex")
LINES = ["the old elephant walked slowly", "to the river with her calf"]
PAGE = render_lines(LINES, size=24, min_side=720)
REFUSAL = (
    "step 1:ocr-cls of pipeline 'ocr' would run 600 rows for this request; it allows at "
    f"most {MAX_LINES} per request"
)


def bomb(columns: int = 20, rows: int = 30, side: int = 600) -> bytes:
    """A page of ``columns`` x ``rows`` tiny words ("ab"), each its own text box: 2 KB of
    PNG that detection cuts into one crop a word."""
    image = Image.new("L", (side, side), 255)
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=10)
    for row in range(rows):
        for column in range(columns):
            xy = (column * side // columns + 1, row * side // rows + 1)
            draw.text(xy, "ab", fill=0, font=font)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


BOMB = bomb()


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("ocr-bounds")
    for name in STEPS:
        link_model(models_dir, root, name)
    build_ocr_pipeline(root)
    return root


def request(image: bytes, **parameters: float) -> tuple[bytes, int | None]:
    return encode_request(
        {"image": np.array([image], dtype=np.object_)},
        binary=True,
        binary_outputs=True,
        parameters=parameters or None,
    )


def lines_of(tensors: Tensors) -> list[str]:
    return [t.decode() for t in tensors["text"].reshape(-1)]


# --- the GPU service ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu(repo: Path) -> Iterator[tuple[asyncio.Runner, DataPlane, ModelRegistry]]:
    """The data plane on a loop the tests run their calls on."""
    with asyncio.Runner() as runner:
        settings = GpuSettings(providers=("CPUExecutionProvider",))
        registry = ModelRegistry(LocalRepository(repo), settings)
        runner.run(registry.start())
        plane = DataPlane(registry, settings)
        try:
            yield runner, plane, registry
        finally:
            runner.run(registry.stop(5))
            plane.close()


def rows_read(registry: ModelRegistry) -> tuple[int, int]:
    """Crops orientation and recognition have computed so far."""
    return (
        registry.get("ocr-cls").stats.inference_count,
        registry.get("ocr-rec").stats.inference_count,
    )


def test_the_gpu_service_refuses_the_bomb_and_reads_the_other_tenants_page(
    gpu: tuple[asyncio.Runner, DataPlane, ModelRegistry],
) -> None:
    runner, plane, registry = gpu
    before = rows_read(registry)

    async def both() -> list[InferResult | BaseException]:
        # WHEN acme's bomb and globex's page arrive together
        return list(
            await asyncio.gather(
                plane.infer("ocr", None, *request(BOMB), stored_scope=ACME),
                plane.infer("ocr", None, *request(PAGE), stored_scope=GLOBEX),
                return_exceptions=True,
            )
        )

    refused, answered = runner.run(both())
    # THEN the bomb is refused with the code and a message that states the limit
    assert isinstance(refused, SpillwayError)
    assert (refused.status, refused.code, refused.message) == (413, "fanout_too_large", REFUSAL)
    # AND globex's page is read, line by line
    assert isinstance(answered, InferResult)
    tensors = decode_response(answered.body, answered.header_length)[1]
    assert lines_of(tensors) == LINES
    # AND no crop of the bomb reached orientation or recognition: only globex's two did
    after = rows_read(registry)
    assert (after[0] - before[0], after[1] - before[1]) == (2, 2)


def test_the_gpu_service_stops_a_page_at_its_deadline(
    gpu: tuple[asyncio.Runner, DataPlane, ModelRegistry],
) -> None:
    runner, plane, registry = gpu
    # GIVEN the detector's time per page measured (one page read, about 0.2 s here)
    runner.run(plane.infer("ocr", None, *request(PAGE), stored_scope=GLOBEX))
    detected = registry.get("ocr-det").stats.inference_count
    before = rows_read(registry)
    # WHEN a page comes whose timeout (50 ms) its detection alone would pass
    with pytest.raises(SpillwayError) as late:
        runner.run(plane.infer("ocr", None, *request(PAGE, timeout=50_000), stored_scope=GLOBEX))
    # THEN it is refused before it runs (the budget sheds it: 429 with a retry hint)
    assert (late.value.status, late.value.code) == (429, "deadline_unmeetable")
    assert late.value.retry_after_s is not None
    # AND nothing ran for it: not its detection, no crop in orientation or recognition
    assert registry.get("ocr-det").stats.inference_count == detected
    assert rows_read(registry) == before


# --- the CPU fallback ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu(repo: Path) -> CpuService:
    return CpuService.load(CpuSettings(repository=str(repo), models=[*STEPS, "ocr"]))


def cpu_infer(cpu: CpuService, image: bytes, tenant: str) -> Tensors:
    encoded = cpu.infer("ocr", None, *request(image), stored_scope=tenant)
    return decode_response(encoded.body, encoded.header_length)[1]


def test_the_cpu_fallback_refuses_the_bomb_and_reads_the_other_tenants_page(
    cpu: CpuService,
) -> None:
    # WHEN acme sends the bomb THEN it is refused as the GPU service refuses it
    with pytest.raises(SpillwayError) as refused:
        cpu_infer(cpu, BOMB, ACME)
    assert (refused.value.status, refused.value.code) == (413, "fanout_too_large")
    assert refused.value.message == REFUSAL
    # AND globex's page is read after it, line by line
    assert lines_of(cpu_infer(cpu, PAGE, GLOBEX)) == LINES
