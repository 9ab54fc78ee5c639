"""The model configuration: Triton's vocabulary as JSON, plus a ``spillway`` block.

``<repository>/<model>/config.json`` holds it. Triton's fields keep Triton's names and
meaning so that ``perf_analyzer`` and ``tritonclient`` read it unchanged; what only
Spillway uses (model kind, tokenizer, length buckets, idle TTL) lives in ``spillway``.
Per-version checksums live beside each version in ``<version>/SHA256SUMS``.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from spillway.canary.records import CanarySpec
from spillway.protocol.datatypes import from_triton_type
from spillway.ensembles.schema import EnsembleScheduling
from spillway.protocol.names import MODEL_NAME_PATTERN

CHECKSUM_FILE = "SHA256SUMS"
CONFIG_FILE = "config.json"

ModelKind = Literal["tensor", "image_classifier", "text_embedding"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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
    canary: CanarySpec | None = None
    """The model's initial canary (``version``, ``stable``, ``percent``, ``bounds``): routers
    start it once per version; afterwards ``spillway models canary`` and the automatic
    rollback change it. Requests that pin no version and bypass the router get ``stable``."""

    @model_validator(mode="after")
    def _text_needs_tokenizer(self) -> SpillwayBlock:
        if self.kind == "text_embedding" and (
            self.tokenizer_file is None or self.max_sequence_length is None
        ):
            raise ValueError("text_embedding models need tokenizer_file and max_sequence_length")
        if list(self.length_buckets) != sorted(set(self.length_buckets)):
            raise ValueError("length_buckets must be strictly increasing")
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
    ensemble_scheduling: EnsembleScheduling | None = None
    """The steps of a pipeline (``platform: "ensemble"``; see ``spillway.ensembles.graph``)."""

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        if not MODEL_NAME_PATTERN.fullmatch(value):
            raise ValueError(f"model name must match {MODEL_NAME_PATTERN.pattern}")
        return value

    @model_validator(mode="after")
    def _ensemble_has_steps(self) -> ModelConfig:
        if (self.platform == "ensemble") != (self.ensemble_scheduling is not None):
            raise ValueError('ensemble_scheduling goes with platform "ensemble", and only with it')
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
