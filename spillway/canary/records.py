"""Canary versions: a model's stable version, its canary and the canary's share of traffic.

A model's canary setting is one record in the router's state table (``canary#<model>``)
that every router instance reads: the stable version, the canary version, the percentage
of unpinned requests the canary gets, the bounds that roll it back automatically, its
status and a short history. The operations are pure functions on ``CanaryState``; the
store applies them with optimistic writes (read, change, write if nobody wrote first), so
two routers that decide the same rollback at once record it once.

* ``start`` begins a canary (or changes its percentage): ``spillway models canary``.
* ``promote`` makes the canary the stable version (explicit, never automatic).
* ``rollback`` sends the canary 0 % with a reason (the router's guard, or an operator),
  and lists the version as rolled back: a request that pins it is refused (409
  ``version_rolled_back``) unless the operator set ``allow_pinned`` on the record
  (``spillway models canary --allow-pinned``); starting the version again takes it off.
* ``seed`` applies a model's ``config.json`` ``spillway.canary`` once per version: a
  version the record already knows (stable, canary or in its history) is never restarted
  by the configuration, so a rolled-back canary stays rolled back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from spillway.models.canary_spec import CanarySpec, RollbackBounds
from spillway.protocol.errors import InvalidInputError
from spillway.protocol.names import validate_model_name
from spillway.state.table import StateStore

Status = Literal["running", "rolled_back", "promoted"]
HISTORY_LENGTH = 20
_ATTEMPTS = 8


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CanaryEvent(_Strict):
    """One change of a canary, for ``spillway models status``."""

    at: float
    """Epoch seconds."""
    event: Literal["started", "percent", "rolled_back", "promoted", "pinning"]
    version: int
    """The canary version the event is about."""
    stable: int
    """The stable version when it happened (for ``promoted``: the one replaced)."""
    percent: float
    reason: str = ""


class CanaryState(_Strict):
    """A model's canary record."""

    model: str
    stable: int = Field(ge=1)
    canary: int | None = Field(default=None, ge=1)
    percent: float = Field(default=0.0, ge=0, le=100)
    status: Status = "promoted"
    bounds: RollbackBounds = RollbackBounds()
    history: tuple[CanaryEvent, ...] = ()
    rolled_back: tuple[int, ...] = ()
    """Versions rolled back and not started again since (the latest ``HISTORY_LENGTH``)."""
    allow_pinned: bool = False
    """Whether a request that pins a rolled-back version is still served by it; by
    default it is refused, so a rollback takes the version out of service for everyone."""

    @property
    def running(self) -> bool:
        """Whether a canary takes traffic (or may, at 0 %)."""
        return self.status == "running" and self.canary is not None

    def choose(self, draw: float) -> int:
        """The version of an unpinned request, for ``draw`` uniform in [0, 1)."""
        if self.running and self.canary is not None and draw * 100 < self.percent:
            return self.canary
        return self.stable

    def serves(self, version: int) -> bool:
        """Whether a session bound to ``version`` keeps it: the stable version, or the
        running canary. A rolled-back or retired version is given up."""
        return version == self.stable or (self.running and version == self.canary)

    def refuses(self, version: int) -> bool:
        """Whether a request pinning ``version`` is refused: it was rolled back and the
        operator has not allowed pinned requests to reach it."""
        return not self.allow_pinned and version in self.rolled_back

    def knows(self, version: int) -> bool:
        """Whether this record has ever had ``version`` as stable or canary."""
        return version in (self.stable, self.canary) or any(
            version in (e.version, e.stable) for e in self.history
        )

    def _with(self, event: CanaryEvent, **changes: object) -> CanaryState:
        history = (*self.history, event)[-HISTORY_LENGTH:]
        return self.model_copy(update={**changes, "history": history})


def start(
    state: CanaryState | None,
    model: str,
    version: int,
    percent: float,
    *,
    at: float,
    stable: int | None = None,
    bounds: RollbackBounds | None = None,
    reason: str = "",
) -> CanaryState:
    """Run ``version`` as the canary at ``percent`` (a running canary of that version
    only changes its share). The first canary of a model names its stable version."""
    validate_model_name(model)
    if not 0 <= percent <= 100:
        raise InvalidInputError("percent must be between 0 and 100")
    if state is None:
        if stable is None:
            raise InvalidInputError(
                f"model {model} has no canary record yet: name the stable version"
            )
        state = CanaryState(model=model, stable=stable)
    elif stable is not None and stable != state.stable:
        raise InvalidInputError(
            f"model {model}'s stable version is {state.stable}; promote a canary to change it"
        )
    if version == state.stable:
        raise InvalidInputError(f"version {version} is already the stable version of {model}")
    kind: Literal["started", "percent"] = (
        "percent" if state.running and state.canary == version else "started"
    )
    event = CanaryEvent(
        at=at, event=kind, version=version, stable=state.stable, percent=percent, reason=reason
    )
    return state._with(
        event,
        canary=version,
        percent=float(percent),
        status="running",
        bounds=bounds or state.bounds,
        rolled_back=tuple(v for v in state.rolled_back if v != version),
    )


def promote(state: CanaryState | None, *, at: float) -> CanaryState:
    """Make the running canary the stable version; the record then has no canary."""
    if state is None or not state.running or state.canary is None:
        raise InvalidInputError("there is no running canary to promote")
    event = CanaryEvent(
        at=at, event="promoted", version=state.canary, stable=state.stable, percent=100.0
    )
    return state._with(event, stable=state.canary, canary=None, percent=0.0, status="promoted")


def rollback(
    state: CanaryState | None, version: int, reason: str, *, at: float
) -> CanaryState | None:
    """Send the canary ``version`` 0 % (``None`` when it is not the running canary any
    more, e.g. another router rolled it back first)."""
    if state is None or not state.running or state.canary != version:
        return None
    event = CanaryEvent(
        at=at, event="rolled_back", version=version, stable=state.stable, percent=0, reason=reason
    )
    withdrawn = (*(v for v in state.rolled_back if v != version), version)[-HISTORY_LENGTH:]
    return state._with(event, percent=0.0, status="rolled_back", rolled_back=withdrawn)


def allow_pinned(state: CanaryState | None, allow: bool, *, at: float) -> CanaryState:
    """Let requests that pin a rolled-back version reach it (``allow``), or refuse them."""
    if state is None:
        raise InvalidInputError("this model has no canary record")
    version = state.canary if state.canary is not None else state.stable
    reason = "pinned requests reach rolled-back versions" if allow else "pinned requests refused"
    event = CanaryEvent(
        at=at,
        event="pinning",
        version=version,
        stable=state.stable,
        percent=state.percent,
        reason=reason,
    )
    return state._with(event, allow_pinned=allow)


def seed(
    state: CanaryState | None, model: str, spec: CanarySpec, *, at: float
) -> CanaryState | None:
    """The record with the configuration's canary started, or ``None`` when the record
    already knows that version (the store, not the file, is then the truth)."""
    if state is not None and state.knows(spec.version):
        return None
    return start(
        state,
        model,
        spec.version,
        spec.percent,
        at=at,
        stable=None if state is not None else spec.stable,
        bounds=spec.bounds,
        reason="config.json",
    )


Change = Callable[[CanaryState | None], CanaryState | None]


class CanaryStore:
    """Canary records in the shared state table, changed with optimistic writes."""

    def __init__(self, store: StateStore, wall: Callable[[], float]) -> None:
        self.store = store
        self.wall = wall

    @staticmethod
    def key(model: str) -> str:
        """The record's key."""
        return f"canary#{validate_model_name(model)}"

    def load(self, model: str) -> CanaryState | None:
        """The model's record, or ``None`` when it never had a canary."""
        item = self.store.get(self.key(model), self.wall())
        return CanaryState.model_validate(item.doc) if item is not None else None

    def apply(self, model: str, change: Change) -> CanaryState | None:
        """Apply ``change`` to the current record and write the result unless another
        writer got there first (then read again and retry); ``None`` when ``change``
        decides there is nothing to write."""
        key = self.key(model)
        for _ in range(_ATTEMPTS):
            item = self.store.get(key, self.wall())
            current = CanaryState.model_validate(item.doc) if item is not None else None
            changed = change(current)
            if changed is None:
                return None
            doc = changed.model_dump(mode="json")
            if item is None:
                written = self.store.create(key, doc, self.wall(), None)
            else:
                written = self.store.replace(key, doc, item.revision, None)
            if written:
                return changed
        raise InvalidInputError(f"the canary of {model} kept changing under this update; retry")

    def start(
        self,
        model: str,
        version: int,
        percent: float,
        *,
        stable: int | None = None,
        bounds: RollbackBounds | None = None,
    ) -> CanaryState:
        """Start a canary or change its percentage."""
        at = self.wall()
        return _written(
            self.apply(
                model,
                lambda s: start(s, model, version, percent, at=at, stable=stable, bounds=bounds),
            )
        )

    def promote(self, model: str) -> CanaryState:
        """Make the running canary stable."""
        at = self.wall()
        return _written(self.apply(model, lambda s: promote(s, at=at)))

    def rollback(self, model: str, version: int, reason: str) -> CanaryState | None:
        """Roll ``version`` back; ``None`` if it was not the running canary."""
        at = self.wall()
        return self.apply(model, lambda s: rollback(s, version, reason, at=at))

    def set_allow_pinned(self, model: str, allow: bool) -> CanaryState:
        """Let pinned requests reach rolled-back versions, or refuse them (the default)."""
        at = self.wall()
        return _written(self.apply(model, lambda s: allow_pinned(s, allow, at=at)))

    def seed(self, model: str, spec: CanarySpec) -> CanaryState | None:
        """Start the configuration's canary unless the record knows its version."""
        at = self.wall()
        return self.apply(model, lambda s: seed(s, model, spec, at=at))


def _written(state: CanaryState | None) -> CanaryState:
    """The record a change that always writes (start, promote) wrote."""
    if state is None:
        raise RuntimeError("a canary change that always writes wrote nothing")
    return state
