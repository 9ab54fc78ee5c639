"""The model configuration: Triton's vocabulary as JSON, plus a ``spillway`` block.

``<repository>/<model>/config.json`` holds it. Triton's fields keep Triton's names and
meaning so that ``perf_analyzer`` and ``tritonclient`` read it unchanged; what only
Spillway uses (model kind, tokenizer, length buckets, idle TTL) lives in ``spillway``.
Per-version checksums live beside each version in ``<version>/SHA256SUMS``.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from spillway.models.canary_spec import CanarySpec
from spillway.models.pipeline_schema import PipelineScheduling
from spillway.protocol.datatypes import from_triton_type
from spillway.protocol.names import MODEL_NAME_PATTERN
from spillway.protocol.wire import MAX_BUDGET_MS, MIN_BUDGET_MS

CHECKSUM_FILE = "SHA256SUMS"
CONFIG_FILE = "config.json"

ModelKind = Literal[
    "tensor",
    "image_classifier",
    "text_embedding",
    "image",
    "ocr_detection",
    "ocr_classification",
    "ocr_recognition",
    "ocr_lines",
]

MAX_IMAGE_SIDE = 8192
"""The largest side of the tensor an image is resized to."""
MAX_IMAGE_PIXELS = 64 * 1024 * 1024
"""The largest ``max_pixels`` a model may set (below Pillow's own bomb warning)."""
MAX_IMAGE_BYTES = 64 * 1024 * 1024
"""The largest ``max_bytes`` a model may set."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


ImageSide = Annotated[int, Field(ge=1, le=MAX_IMAGE_SIDE)]


class ImageSpec(_Strict):
    """How an ``image`` model prepares its image input: each row of a served BYTES input
    is one encoded JPEG or PNG image, decoded, converted to ``color``, resized to ``size``
    and normalised, ``(pixel * scale - mean) / std`` per channel, into the graph's float
    input in ``layout``. The request's other inputs go to the graph unchanged.

    Variable width (``height`` and ``max_width`` instead of ``size``, as a text
    recogniser takes crops of a line): every image is resized to ``height``, its width
    from its aspect ratio, and padded on the right to its width bucket; the graph's width
    dimension must be dynamic."""

    input: str = Field(min_length=1, max_length=128)
    """The served BYTES input (one element per row); the graph input of the same name, or
    else the one graph input that no other served input names, receives the tensor."""
    layout: Literal["NCHW", "NHWC"] = "NCHW"
    color: Literal["RGB", "BGR", "GRAY"] = "RGB"
    """The channels' order (GRAY: one channel, ITU-R 601 luma)."""
    size: tuple[ImageSide, ImageSide] | None = None
    """``[height, width]`` of the tensor (or else ``height`` and ``max_width``)."""
    height: ImageSide | None = None
    """Variable width: the height of the tensor; a row's width is ``ceil(height * w / h)``
    for a ``w``×``h`` image, at most ``max_width``."""
    max_width: ImageSide | None = None
    """Variable width: the widest row."""
    width_buckets: tuple[ImageSide, ...] | None = None
    """Variable width: the widths a request's rows are padded to on the right with 0
    after normalisation, as PP-OCR pads (strictly increasing, the last at most
    ``max_width``): the first that holds its widest row, else ``max_width``. Requests of
    one bucket batch together; two buckets never share a batch."""
    resize: Literal["stretch", "letterbox"] = "stretch"
    """``stretch`` to ``size``; ``letterbox`` keeps the aspect ratio, centred on
    ``pad_value`` (with ``size`` only)."""
    interpolation: Literal["nearest", "bilinear", "bicubic", "lanczos"] = "bilinear"
    pad_value: int = Field(default=0, ge=0, le=255)
    """The pixel value around a letterboxed image (normalised like any pixel)."""
    scale: float = Field(default=1 / 255, gt=0, le=1)
    mean: tuple[float, ...] = (0.0,)
    """One value for every channel, or one per channel in ``color``'s order."""
    std: tuple[float, ...] = (1.0,)
    """Like ``mean``; every value positive."""
    max_pixels: int = Field(default=16 * 1024 * 1024, ge=1, le=MAX_IMAGE_PIXELS)
    """The most pixels an image's header may declare; more is ``image_too_large`` (400)
    before anything is decoded."""
    max_bytes: int = Field(default=8 * 1024 * 1024, ge=1, le=MAX_IMAGE_BYTES)
    """The longest encoded image; longer is ``payload_too_large`` (413), not opened. For
    the image input it replaces the service's per-element cap (``max_bytes_per_element``);
    the service's body limit still applies."""

    @property
    def channels(self) -> int:
        """The channels of the tensor: 1 for GRAY, else 3."""
        return 1 if self.color == "GRAY" else 3

    @property
    def tensor_height(self) -> int:
        """The height of the tensor, fixed or with a variable width."""
        return self.size[0] if self.size is not None else self.height or 0

    @model_validator(mode="after")
    def _per_channel(self) -> ImageSpec:
        for field, values in (("mean", self.mean), ("std", self.std)):
            if len(values) not in (1, self.channels):
                raise ValueError(
                    f"image {field} needs 1 or {self.channels} values for {self.color}"
                )
        if any(not 0 < s < float("inf") for s in self.std):
            raise ValueError("image std values must be positive")
        if any(not abs(m) < float("inf") for m in self.mean):
            raise ValueError("image mean values must be finite")
        return self

    @model_validator(mode="after")
    def _one_size(self) -> ImageSpec:
        if (self.size is None) == (self.height is None):
            raise ValueError("an image section needs size, or else height and max_width")
        if (self.height is None) != (self.max_width is None):
            raise ValueError("image height and max_width go together")
        if self.size is not None and self.width_buckets is not None:
            raise ValueError("width_buckets go with height and max_width, not size")
        if self.height is not None and self.resize != "stretch":
            raise ValueError("a variable-width image keeps its aspect ratio: resize is for size")
        buckets = list(self.width_buckets or ())
        if buckets != sorted(set(buckets)):
            raise ValueError("width_buckets must be strictly increasing")
        if buckets and self.max_width is not None and buckets[-1] > self.max_width:
            raise ValueError(f"width_buckets must end at most at max_width {self.max_width}")
        return self


class TensorConfig(_Strict):
    """One input or output: ``dims`` exclude the batch dimension when batching."""

    name: str = Field(min_length=1, max_length=128)
    data_type: str
    dims: tuple[int, ...]

    @field_validator("data_type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        from_triton_type(value)
        return value

    @field_validator("dims")
    @classmethod
    def _valid_dims(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(d == 0 or d < -1 for d in value):
            raise ValueError("dims must be positive or -1 (variable)")
        return value

    @property
    def datatype(self) -> str:
        """The Open Inference Protocol datatype (``FP32``, ``BYTES`` …)."""
        return from_triton_type(self.data_type)


class QueuePolicy(_Strict):
    """Triton's queue policy: a bound on waiting requests and their default timeout.

    Only ``timeout_action: REJECT`` is served (an expired request gets 504); Triton's
    ``DELAY`` is refused when the model loads rather than silently treated as REJECT."""

    max_queue_size: int = Field(default=256, ge=1)
    default_timeout_microseconds: int = Field(default=0, ge=0)
    timeout_action: Literal["REJECT"] = "REJECT"
    allow_timeout_override: bool = True


class DynamicBatching(_Strict):
    """Triton's dynamic batcher settings (a subset with the same names)."""

    preferred_batch_size: tuple[int, ...] = ()
    max_queue_delay_microseconds: int = Field(default=2000, ge=0)
    priority_levels: int = Field(default=1, ge=1, le=16)
    default_priority_level: int = Field(default=0, ge=0)
    """0: the lowest level (``priority_levels``)."""
    default_queue_policy: QueuePolicy = QueuePolicy()

    @model_validator(mode="after")
    def _default_level_exists(self) -> DynamicBatching:
        if self.default_priority_level > self.priority_levels:
            raise ValueError(
                f"default_priority_level {self.default_priority_level} exceeds "
                f"priority_levels {self.priority_levels}"
            )
        return self


class VersionPolicy(_Strict):
    """Which versions to serve: the latest N, all, or a specific list (Triton's names)."""

    latest: dict[Literal["num_versions"], int] | None = None
    all: dict[str, object] | None = None
    specific: dict[Literal["versions"], tuple[int, ...]] | None = None


class ComputeSpec(_Strict):
    """What one run of the model needs from the device it is served on, and its place
    in that device's order (the GPU service's compute budget, docs/gpu-service.md)."""

    priority: int = Field(default=2, ge=1, le=4)
    """1 first: while a run of a model at a better level waits for the device, no model
    at a worse level starts one. Within a level the earliest deadline goes first."""
    slots: int = Field(default=1, ge=1, le=16)
    """Slots of the device's budget one run holds (on a CPU host, a slot is a core: the
    run computes on that many ONNX Runtime threads)."""


class SpillwayBlock(_Strict):
    """What only Spillway uses; Triton would ignore an unknown block, so keep it apart."""

    kind: ModelKind = "tensor"
    onnx_file: str = "model.onnx"
    tokenizer_file: str | None = None
    max_sequence_length: int | None = Field(default=None, ge=1)
    length_buckets: tuple[int, ...] = ()
    idle_ttl_seconds: float | None = Field(default=None, gt=0)
    pinned: bool = False
    description: str = ""
    image: ImageSpec | None = None
    """How an ``image`` model decodes and prepares its image input (with that kind only)."""
    non_finite_inputs: tuple[str, ...] = ()
    """Floating-point inputs that may hold NaN or an infinity (a tree model reading NaN as
    a missing value, say). Every other floating-point input refuses them with
    ``non_finite_input``, on every door alike."""
    canary: CanarySpec | None = None
    """The model's initial canary (``version``, ``stable``, ``percent``, ``bounds``): routers
    start it once per version; afterwards ``spillway models canary`` and the automatic
    rollback change it. Requests that pin no version and bypass the router get ``stable``."""
    latency_budget_ms: float | None = Field(default=None, ge=MIN_BUDGET_MS, le=MAX_BUDGET_MS)
    """How long the router waits for a request of this model that states no latency budget
    of its own (``x-spillway-latency-budget-ms`` still wins), in milliseconds, within the
    bounds a request's own budget has (100 ms to 1 h); unset: the router's default
    (``ROUTER_DEFAULT_DEADLINE_MS``, 5 s). A pipeline's is at most its ``timeout_s``."""
    compute: ComputeSpec = ComputeSpec()
    """Its runs' share of the device and their priority level (GPU service)."""

    @property
    def batch_buckets(self) -> tuple[int, ...]:
        """The edges the batcher queues requests apart by (``Prepared.length``): token
        lengths for text, padded widths for a variable-width image."""
        image = self.image
        return (image.width_buckets or ()) if image is not None else self.length_buckets

    @model_validator(mode="after")
    def _text_needs_tokenizer(self) -> SpillwayBlock:
        if self.kind == "text_embedding" and (
            self.tokenizer_file is None or self.max_sequence_length is None
        ):
            raise ValueError("text_embedding models need tokenizer_file and max_sequence_length")
        if list(self.length_buckets) != sorted(set(self.length_buckets)):
            raise ValueError("length_buckets must be strictly increasing")
        if (self.kind == "image") != (self.image is not None):
            raise ValueError('an image section goes with kind "image", and only with it')
        return self


class ModelConfig(_Strict):
    """A model's configuration, as stored in ``config.json``."""

    name: str
    platform: Literal["onnxruntime_onnx", "ensemble"] = "onnxruntime_onnx"
    max_batch_size: int = Field(default=0, ge=0)
    input: tuple[TensorConfig, ...] = Field(min_length=1)
    output: tuple[TensorConfig, ...] = Field(min_length=1)
    dynamic_batching: DynamicBatching | None = None
    version_policy: VersionPolicy = VersionPolicy(latest={"num_versions": 1})
    spillway: SpillwayBlock = SpillwayBlock()
    ensemble_scheduling: PipelineScheduling | None = None
    """The steps of a pipeline (``platform: "ensemble"``; see ``spillway.pipelines.graph``)."""

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        if not MODEL_NAME_PATTERN.fullmatch(value):
            raise ValueError(f"model name must match {MODEL_NAME_PATTERN.pattern}")
        return value

    @model_validator(mode="after")
    def _pipeline_has_steps(self) -> ModelConfig:
        if (self.platform == "ensemble") != (self.ensemble_scheduling is not None):
            raise ValueError('ensemble_scheduling goes with platform "ensemble", and only with it')
        return self

    @model_validator(mode="after")
    def _image_input_served(self) -> ModelConfig:
        image = self.spillway.image
        if image is None:
            return self
        spec = next((t for t in self.input if t.name == image.input), None)
        if spec is None or spec.datatype != "BYTES" or any(d != 1 for d in spec.dims):
            raise ValueError(
                f"image input {image.input!r} must be a served BYTES input of dims [1] "
                "(one encoded image per row)"
            )
        return self

    @model_validator(mode="after")
    def _non_finite_inputs_float(self) -> ModelConfig:
        floats = {t.name for t in self.input if t.datatype.startswith("FP")}
        wrong = sorted(set(self.spillway.non_finite_inputs) - floats)
        if wrong:
            raise ValueError(f"non_finite_inputs names no floating-point input: {wrong}")
        return self

    @model_validator(mode="after")
    def _budget_within_pipeline_timeout(self) -> ModelConfig:
        """A pipeline stops a request at its ``timeout_s``: a longer budget is never used."""
        budget, scheduling = self.spillway.latency_budget_ms, self.ensemble_scheduling
        if budget is not None and scheduling is not None:
            timeout_ms = scheduling.spillway.timeout_s * 1000
            if budget > timeout_ms:
                raise ValueError(
                    f"spillway.latency_budget_ms ({budget:g}) exceeds the pipeline's "
                    f"timeout_s ({timeout_ms:g} ms)"
                )
        return self

    @property
    def is_pipeline(self) -> bool:
        """Whether this is a pipeline of other models rather than an ONNX model."""
        return self.ensemble_scheduling is not None

    @model_validator(mode="after")
    def _canary_versions_served(self) -> ModelConfig:
        """A canary needs both of its versions loaded wherever the model is served."""
        canary = self.spillway.canary
        if canary is None:
            return self
        policy = self.version_policy
        if policy.specific is not None:
            missing = {canary.version, canary.stable} - set(policy.specific["versions"])
            if missing:
                raise ValueError(
                    f"version_policy.specific must list the canary's versions {sorted(missing)}"
                )
        elif policy.all is None and (policy.latest or {}).get("num_versions", 1) < 2:
            raise ValueError(
                "a canary needs two versions served: version_policy specific (both), all, "
                "or latest with num_versions >= 2"
            )
        return self

    def default_version(self, ready: Collection[int]) -> int | None:
        """The version a request that pins none gets among ``ready``: the canary's stable
        version while a canary is configured, else the newest."""
        if not ready:
            return None
        canary = self.spillway.canary
        if canary is not None and canary.stable in ready:
            return canary.stable
        return max(ready)

    def to_json_dict(self) -> dict[str, object]:
        """The JSON form served at ``/v2/models/{m}/config``."""
        return self.model_dump(mode="json", exclude_none=True)
