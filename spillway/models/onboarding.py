"""Adding a model from its ONNX file: configuration, batch-safety proof, profile, proposal.

``spillway.models.new_version.add_model`` writes nothing to the target repository until
the model has been proven: the version is first published to a scratch repository and
loaded from there by the servers' own loader (``spillway.models.loader``), so the proof
runs what serving runs.

The proof: generated inputs (a fixed seed) for ``PROOF_ROWS`` rows, run once as one batch
and once row by row; a model whose batched answers differ from its single-row ones mixes
rows across the batch (it normalises over axis 0, say) and is served one request per run
(``max_batch_size`` 0, no dynamic batching). A batch-safe model is profiled at
``PROFILE_BATCHES`` and given the dynamic batcher settings that fit a p99 target.

An image model's generated inputs are encoded images, random pixels at the model's size
saved as PNG, so the proof and the profile decode, resize and normalise as serving does.
Noise, not smooth images: a reduction over many equal or similar pixels (a global mean)
drifts in float32 by more than ``FLOAT_RTOL`` between a batch and a single row in ONNX
Runtime, and the proof would call a batch-safe model unsafe.
"""

from __future__ import annotations

import io
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from spillway.models.config import (
    DynamicBatching,
    ImageSpec,
    ModelConfig,
    SpillwayBlock,
    TensorConfig,
)
from spillway.models.engine import OnnxModel
from spillway.models.processing import Tensors
from spillway.models.signature import (
    GraphSignature,
    tensor_config,
)
from spillway.protocol.datatypes import numpy_dtype
from spillway.protocol.errors import InferenceError, ModelLoadError

ONNX_FILE = "model.onnx"
TOKENIZER_FILE = "tokenizer.json"
TEXT_INPUT = "text"
TEXT_GRAPH_INPUTS = ("input_ids", "attention_mask")
DEFAULT_SEQUENCE_LENGTH = 512
PROOF_ROWS = 8
PROOF_SEED = 0
FLOAT_RTOL = 1e-4
FLOAT_ATOL = 1e-5
"""Batched and single-row float answers agree within ``rtol``/``atol`` (numpy's
``allclose``): a batched kernel sums in another order, never more than this apart."""
SYMBOLIC_SIZE = 4
"""The size a generated input gets for a dynamic dimension other than the batch."""
PROFILE_BATCHES = (1, 8, 32)
WARM_RUNS = 3
TIMED_RUNS = 20


@dataclass(frozen=True)
class BatchProof:
    """Whether ``rows`` rows run as one batch answer as the rows run one by one."""

    safe: bool
    rows: int
    detail: str
    """One line: what was compared and, when unsafe, where it differed."""


@dataclass(frozen=True)
class ProfileRow:
    """Compute time of one batch size (milliseconds) and its throughput."""

    batch: int
    p50_ms: float
    p99_ms: float

    @property
    def rows_per_s(self) -> float:
        """Rows per second at the median time."""
        return self.batch / (self.p50_ms / 1e3) if self.p50_ms > 0 else float("inf")


@dataclass(frozen=True)
class Proposal:
    """Dynamic batcher settings for a p99 target, and why."""

    max_batch_size: int
    preferred_batch_size: tuple[int, ...]
    max_queue_delay_microseconds: int
    reason: str

    def batching(self) -> DynamicBatching | None:
        """The ``dynamic_batching`` block (none where a batch of one is all that fits)."""
        if self.max_batch_size <= 1:
            return None
        return DynamicBatching(
            preferred_batch_size=self.preferred_batch_size,
            max_queue_delay_microseconds=self.max_queue_delay_microseconds,
        )


# -- the configuration -------------------------------------------------------------------


def text_config(
    name: str, signature: GraphSignature, max_sequence_length: int, max_batch_size: int
) -> ModelConfig:
    """A ``text_embedding`` model's configuration: one served ``text`` string per row in,
    the graph's first output (``[batch, dim]``, pooled) out. ModelLoadError in one line
    when the graph is not what the text kind feeds (``input_ids`` and ``attention_mask``,
    int64 ``[batch, sequence]``, both dimensions dynamic)."""
    shapes = {t.name: t for t in signature.inputs}
    if sorted(shapes) != sorted(TEXT_GRAPH_INPUTS):
        raise ModelLoadError(
            f"a text model's graph takes exactly {' and '.join(TEXT_GRAPH_INPUTS)}; "
            f"this one takes {', '.join(sorted(shapes))}"
        )
    for tensor in shapes.values():
        dynamic = len(tensor.shape) == 2 and not any(isinstance(d, int) for d in tensor.shape)
        if tensor.datatype != "INT64" or not dynamic:
            raise ModelLoadError(
                f"a text model's {tensor.name} must be INT64 [batch, sequence] with both "
                f"dimensions dynamic; it is {tensor.datatype} {list(tensor.shape)}"
            )
    output = signature.outputs[0]
    if len(output.shape) != 2 or isinstance(output.shape[0], int):
        raise ModelLoadError(
            f"a text model's first output must be a pooled [batch, dim] embedding; "
            f"{output.name} is {list(output.shape)}"
        )
    return ModelConfig(
        name=name,
        max_batch_size=max_batch_size,
        input=(TensorConfig(name=TEXT_INPUT, data_type="TYPE_STRING", dims=(1,)),),
        output=(tensor_config(output, batching=True),),
        spillway=SpillwayBlock(
            kind="text_embedding",
            tokenizer_file=TOKENIZER_FILE,
            max_sequence_length=max_sequence_length,
        ),
    )


def tokenizer_max_length(path: Path) -> int | None:
    """The truncation length a ``tokenizer.json`` sets, if it sets one."""
    try:
        truncation = json.loads(path.read_text(encoding="utf-8")).get("truncation")
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelLoadError(f"{path.name} is not a tokenizers JSON file: {exc}") from exc
    length = truncation.get("max_length") if isinstance(truncation, dict) else None
    return length if isinstance(length, int) and length > 0 else None


def configure(
    config: ModelConfig, proof: BatchProof | None, proposal: Proposal | None
) -> ModelConfig:
    """The configuration to publish: batching as proven and proposed; a model that is
    not batch-safe is served one request per run, its whole shape as ``dims`` (an image
    model's served image input stays ``[1]``: one image per request)."""
    if config.max_batch_size == 0:
        return config
    if proof is not None and not proof.safe:
        if config.spillway.kind == "text_embedding":
            raise ModelLoadError(f"a text model must be batch-safe: {proof.detail}")
        return _unbatched(config)
    if proposal is None:
        return config
    return config.model_copy(
        update={
            "max_batch_size": proposal.max_batch_size,
            "dynamic_batching": proposal.batching(),
        }
    )


def _unbatched(config: ModelConfig) -> ModelConfig:
    image = config.spillway.image

    def whole(spec: TensorConfig) -> TensorConfig:
        if image is not None and spec.name == image.input:
            return spec
        return spec.model_copy(update={"dims": (-1, *spec.dims)})

    return config.model_copy(
        update={
            "max_batch_size": 0,
            "dynamic_batching": None,
            "input": tuple(whole(t) for t in config.input),
            "output": tuple(whole(t) for t in config.output),
        }
    )


# -- the proof ---------------------------------------------------------------------------


def generated_inputs(config: ModelConfig, rows: int, seed: int = PROOF_SEED) -> Tensors:
    """Inputs of ``rows`` rows for the served signature: floats from a normal
    distribution, integers in 0..3, text of varying length, an image model's images as
    PNGs (``random_png``); a fixed seed."""
    rng = np.random.default_rng(seed)
    image = config.spillway.image
    inputs: Tensors = {}
    for spec in config.input:
        shape = [rows, *(d if d > 0 else SYMBOLIC_SIZE for d in spec.dims)]
        dtype = numpy_dtype(spec.datatype)
        if image is not None and spec.name == image.input:
            pngs = [random_png(image, rng) for _ in range(int(np.prod(shape)))]
            inputs[spec.name] = np.array(pngs, np.object_).reshape(shape)
        elif spec.datatype == "BYTES":
            words = rng.integers(1, 12, size=shape)
            texts = [" ".join(["sample"] * int(n)) + f" {i}" for i, n in enumerate(words.flat)]
            inputs[spec.name] = np.array([t.encode() for t in texts], np.object_).reshape(shape)
        elif spec.datatype == "BOOL":
            inputs[spec.name] = rng.random(shape) < 0.5
        elif np.issubdtype(dtype, np.integer):
            inputs[spec.name] = rng.integers(0, 4, size=shape).astype(dtype)
        else:
            inputs[spec.name] = rng.standard_normal(shape).astype(dtype)
    return inputs


def random_png(spec: ImageSpec, rng: np.random.Generator) -> bytes:
    """A PNG of random pixels at ``spec``'s size (at a variable-width spec's height, twice
    as wide, within ``max_width``)."""
    if spec.size is not None:
        height, width = spec.size
    else:
        height = spec.tensor_height
        width = min(2 * height, spec.max_width or 2 * height)
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def prove_batching(model: OnnxModel, rows: int = PROOF_ROWS) -> BatchProof:
    """Run ``rows`` generated rows as one batch and one by one, through the served path
    (validate, prepare, run), and compare: floats with ``allclose(rtol=FLOAT_RTOL,
    atol=FLOAT_ATOL)``, everything else exactly."""
    inputs = generated_inputs(model.config, rows)
    singles = [model.infer({n: a[i : i + 1] for n, a in inputs.items()}) for i in range(rows)]
    try:
        batched = model.infer(inputs)
    except InferenceError as exc:
        return BatchProof(False, rows, f"a batch of {rows} rows fails: {exc.message}")
    for name in model.output_names:
        for row, single in enumerate(singles):
            if not _same(batched[name][row : row + 1], single[name]):
                return BatchProof(
                    False,
                    rows,
                    f"output {name!r} of row {row} differs when {rows} rows run as one batch "
                    "(the model mixes rows across the batch)",
                )
    return BatchProof(
        True,
        rows,
        f"a batch of {rows} equals its {rows} single-row runs "
        f"(floats within rtol {FLOAT_RTOL:g}, atol {FLOAT_ATOL:g}; others exact)",
    )


def _same(batched: np.ndarray, single: np.ndarray) -> bool:
    if batched.shape != single.shape:
        return False
    if np.issubdtype(batched.dtype, np.floating):
        return bool(np.allclose(batched, single, rtol=FLOAT_RTOL, atol=FLOAT_ATOL, equal_nan=True))
    return bool(np.array_equal(batched, single))


# -- the profile and the proposal --------------------------------------------------------


def profile(
    model: OnnxModel,
    batches: Sequence[int] = PROFILE_BATCHES,
    *,
    warm: int = WARM_RUNS,
    runs: int = TIMED_RUNS,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[ProfileRow, ...]:
    """Median and p99 compute time of each batch size through the served path."""
    table = []
    for batch in batches:
        inputs = generated_inputs(model.config, batch)
        for _ in range(warm):
            model.infer(inputs)
        times = []
        for _ in range(runs):
            started = clock()
            model.infer(inputs)
            times.append((clock() - started) * 1e3)
        table.append(ProfileRow(batch, statistics.median(times), _p99(times)))
    return tuple(table)


def _p99(times: list[float]) -> float:
    return float(np.percentile(times, 99))


def propose(table: Sequence[ProfileRow], p99_ms: float) -> Proposal:
    """Dynamic batcher settings for a p99 target of ``p99_ms``.

    A request may wait the queue delay, then behind a batch already running, then for its
    own batch: the largest profiled batch whose p99 fits twice within the target is
    ``max_batch_size``; the queue delay is what the target leaves, at most one median
    compute of that batch (waiting longer gathers few more rows than running would); the
    profiled sizes above 1 up to it are preferred."""
    rows = sorted(table, key=lambda r: r.batch)
    fitting = [r for r in rows if 2 * r.p99_ms <= p99_ms]
    if not fitting:
        first = rows[0]
        return Proposal(
            first.batch,
            (),
            0,
            f"even a batch of {first.batch} takes {first.p99_ms:.1f} ms at p99, over half "
            f"the {p99_ms:g} ms target: no queue delay",
        )
    chosen = fitting[-1]
    delay_ms = min(p99_ms - 2 * chosen.p99_ms, chosen.p50_ms)
    preferred = tuple(r.batch for r in rows if 1 < r.batch <= chosen.batch)
    larger = [r for r in rows if r.batch > chosen.batch]
    why = (
        f"a batch of {larger[0].batch} takes {larger[0].p99_ms:.1f} ms at p99, more than "
        f"half the {p99_ms:g} ms target"
        if larger
        else f"the largest profiled batch fits the {p99_ms:g} ms target"
    )
    return Proposal(
        chosen.batch,
        preferred,
        round(delay_ms * 1e3),
        f"batch {chosen.batch} (p99 {chosen.p99_ms:.1f} ms) runs twice within the "
        f"target with {delay_ms:.1f} ms of queue delay; {why}",
    )
