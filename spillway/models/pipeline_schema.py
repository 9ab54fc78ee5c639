"""The ``ensemble_scheduling`` block of a pipeline's ``config.json``.

Triton's vocabulary, with Triton's meaning: a pipeline (``platform: "ensemble"``) lists
``step``\\ s, each naming a model (``model_name``, ``model_version``; -1 is whatever
version that model serves) and how the pipeline's tensors feed it (``input_map``: the
step model's input -> a pipeline tensor) and what it adds (``output_map``: the step
model's output -> a new pipeline tensor). What Triton has no word for lives in a step's
own ``spillway`` block: a ``condition`` (run the step only when a tensor passes a
threshold, the "light model first" rule) and ``cache`` (reuse the step's outputs for
inputs it has seen). A step's cache is kept per tenant; ``cache_scope: "shared"`` shares
it across tenants, which the pipeline may declare only for a step whose inputs are
public: every tensor it reads comes from inputs listed in the scheduling's own
``spillway.public_inputs`` (checked when the pipeline loads). ``map`` runs a step over
the rows of a variable-length tensor (fan-out) and gathers its outputs per item, in
order (fan-in): ``spillway.pipelines.fanout``; its ``max_rows`` bounds what one request
may run through it, and the scheduling's ``timeout_s`` bounds a request's whole run.

Only what one configuration can check on its own is checked here; whether the step
models exist and fit together is checked when the pipeline loads (``spillway.pipelines.graph``).
The schema lives with the models because a model's configuration (``spillway.models.config``)
holds it; ``spillway.pipelines``, a layer above, reads it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from spillway.protocol.names import MODEL_NAME_PATTERN

TensorName = str


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StepCondition(_Strict):
    """Run the step only when ``tensor`` passes ``op value`` for a request.

    Each row of the tensor becomes one number: its value at ``element`` (a flat index
    within the row), or its ``reduce`` (max, min, mean) when no element is named; the
    step runs when ``rows`` of them (``any`` or ``all``) pass."""

    tensor: TensorName = Field(min_length=1, max_length=128)
    op: Literal[">", ">=", "<", "<="]
    value: float
    element: int | None = Field(default=None, ge=0)
    reduce: Literal["max", "min", "mean"] = "max"
    rows: Literal["any", "all"] = "any"


DEFAULT_MAX_ROWS = 256
"""A mapped step's ``max_rows`` when its configuration names none."""
MAX_ROWS_LIMIT = 65536
"""The largest ``max_rows`` a pipeline may declare."""
DEFAULT_TIMEOUT_S = 60.0
"""A pipeline's ``timeout_s`` when its configuration names none."""


class StepMap(_Strict):
    """Run the step over rows (fan-out) and gather its outputs per item (fan-in).

    Each of the request's items has ``counts`` rows in the tensors ``over`` names; the
    step model gets those rows as rows of its own (in chunks of its max_batch_size, or
    one by one when it does not batch), and each output comes back per item, in order,
    laid out as the tensors mapped over (``spillway.pipelines.fanout``)."""

    over: tuple[TensorName, ...] = Field(min_length=1, max_length=16)
    """The tensors whose rows the step runs over (a name, or a list of names sharing
    ``counts``); they are exactly what the step's ``input_map`` reads."""
    counts: TensorName = Field(min_length=1, max_length=128)
    """INT32 or INT64, one number per item: how many rows of ``over`` are that item's."""
    max_rows: int = Field(default=DEFAULT_MAX_ROWS, ge=1, le=MAX_ROWS_LIMIT)
    """The most rows one request may run through the step (its items' counts summed): a
    request that would run more is refused, 413 ``fanout_too_large``, before the step
    runs, on every runtime. Its work is what a request may cost: set it to what a real
    input needs (``ocr``: a dense two-column page has about 200 lines)."""

    @field_validator("over", mode="before")
    @classmethod
    def _one_or_more(cls, value: object) -> object:
        return (value,) if isinstance(value, str) else value


class StepOptions(_Strict):
    """What only Spillway does with a step."""

    condition: StepCondition | None = None
    map: StepMap | None = None
    """Run the step over the rows of a variable-length tensor (fan-out/fan-in)."""
    cache: bool = False
    """Keep the step's outputs by (tenant, model, version, hash of its inputs) and reuse
    them for the same tenant."""
    cache_scope: Literal["tenant", "shared"] = "tenant"
    """``shared``: one entry for every tenant, for a step whose inputs are public (it
    reads only tensors made from ``public_inputs``); no answer then says it was cached.
    A step reading anything a tenant sent must stay ``tenant``: another tenant's hit
    (and its speed) would tell what was sent."""

    @model_validator(mode="after")
    def _shared_needs_cache(self) -> StepOptions:
        if self.cache_scope == "shared" and not self.cache:
            raise ValueError('cache_scope "shared" needs cache: true')
        return self


class PipelineStep(_Strict):
    """One step: a model and the tensors it reads and adds."""

    model_name: str = Field(pattern=MODEL_NAME_PATTERN.pattern)
    model_version: int = -1
    """-1: the version the model serves (its newest, or its canary's stable one)."""
    input_map: dict[str, TensorName] = Field(min_length=1)
    output_map: dict[str, TensorName] = Field(min_length=1)
    spillway: StepOptions = StepOptions()

    @field_validator("model_version")
    @classmethod
    def _version(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("model_version is a version number or -1 (the served one)")
        return value

    @model_validator(mode="after")
    def _map_reads_what_it_maps(self) -> PipelineStep:
        mapped = self.spillway.map
        if mapped is not None and set(self.input_map.values()) != set(mapped.over):
            raise ValueError(
                f"a mapped step's input_map reads exactly the tensors of map.over "
                f"({sorted(mapped.over)}), not {sorted(set(self.input_map.values()))}"
            )
        return self


class SchedulingOptions(_Strict):
    """What only Spillway knows about a pipeline as a whole."""

    public_inputs: tuple[TensorName, ...] = ()
    """Pipeline inputs that hold nothing private to a tenant (e.g. a fixed label set every
    client sends): only steps that read nothing else may share their cache."""
    timeout_s: float = Field(default=DEFAULT_TIMEOUT_S, gt=0, le=3600)
    """The longest one request may take through the pipeline, from its arrival (a
    request's own ``timeout`` may only lower it): once it has passed, no further step or
    chunk of rows starts and the request is answered 504 ``deadline_exceeded``, so a
    request's total compute is bounded on a server (the batch job, offline, has none)."""


class PipelineScheduling(_Strict):
    """Triton's ``ensemble_scheduling``: the steps, in any order (tensors decide it)."""

    step: tuple[PipelineStep, ...] = Field(min_length=1, max_length=64)
    spillway: SchedulingOptions = SchedulingOptions()

    @model_validator(mode="after")
    def _each_tensor_made_once(self) -> PipelineScheduling:
        made: set[str] = set()
        for step in self.step:
            for tensor in step.output_map.values():
                if tensor in made:
                    raise ValueError(f"pipeline tensor {tensor!r} is produced by two steps")
                made.add(tensor)
        return self
