"""The ``spillway.canary`` block of a model's ``config.json``: its initial canary.

A model may name the canary it starts with (``version``, ``stable``, ``percent``) and the
bounds that roll it back automatically. Routers start it once per version
(``spillway.canary.records.seed``); afterwards the canary record in the state table, not
the file, is the truth. The spec lives with the models because a model's configuration
(``spillway.models.config``) holds it; ``spillway.canary``, a layer above, reads it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RollbackBounds(_Strict):
    """When a canary is worse enough than the stable version to be rolled back."""

    max_error_rate_increase: float = Field(default=0.01, ge=0, le=1)
    """Roll back when the canary's server-fault rate exceeds the stable version's by more
    than this (0.01: one percentage point)."""
    max_p99_ratio: float = Field(default=1.5, ge=1)
    """Roll back when the canary's p99 latency exceeds the stable version's times this..."""
    min_p99_increase_ms: float = Field(default=10.0, ge=0)
    """...and by at least this many milliseconds (jitter on millisecond latencies is not a
    regression)."""
    min_requests: int = Field(default=50, ge=1)
    """Requests each version needs in the window before they are compared."""
    window_s: float = Field(default=60.0, gt=0, le=3600)
    """The sliding window the rates and p99s are computed over."""


class CanarySpec(_Strict):
    """``config.json`` ``spillway.canary``: the initial canary of a model."""

    version: int = Field(ge=1)
    stable: int = Field(ge=1)
    percent: float = Field(ge=0, le=100)
    bounds: RollbackBounds = RollbackBounds()

    @model_validator(mode="after")
    def _two_versions(self) -> CanarySpec:
        if self.version == self.stable:
            raise ValueError("the canary version must differ from the stable version")
        return self
