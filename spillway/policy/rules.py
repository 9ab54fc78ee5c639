"""The routing policy: ordered rules, validated by pydantic, read from YAML or JSON.

A rule matches when every condition it names holds (lists: any of); the first rule that
matches decides. Its action routes to a backend, optionally spilling a share of the
matching traffic to another one; the chain after it is the rule's ``fallback`` or the
policy's ``fallbacks`` for the routed backend. The last rule has no conditions (the
default). Requests that are not inference (metadata, readiness, config, statistics)
follow the same rules but skip ``batch``.

Priority follows Triton: 1 is the highest; a request without one has
``defaults.priority``. A tenant's tier comes from ``tenants`` (else ``defaults.tenant_tier``).

``capture`` says which inference requests data capture keeps (``spillway.capture``,
docs/capture.md): a list of entries tried in order, the first whose ``model`` and
``tenant`` globs hold deciding its sample rate and what it keeps; no entry: nothing is kept.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from datetime import datetime, time, timedelta
from fnmatch import fnmatchcase
from typing import Annotated, Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from spillway.protocol.wire import SYNC_BODY_BYTES

Backend = Literal["gpu", "cpu", "batch"]
Mode = Literal["auto", "realtime", "serverless", "batch"]
Weekday = Literal["mon", "tue", "wed", "thu", "fri", "sat", "sun"]
WEEKDAYS: tuple[Weekday, ...] = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
RuleName = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_.-]{0,63}$")]
Glob = Annotated[str, Field(min_length=1, max_length=256)]
Globs = Annotated[list[Glob], Field(min_length=1)]
_CLOCK = re.compile(r"^([01]\d|2[0-3]):([0-5]\d)$")


class PolicyError(ValueError):
    """A policy file that cannot be used; the message says where and why."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Range(_Strict):
    """Bounds on a number; a request without the number does not match."""

    lt: float | None = None
    le: float | None = None
    gt: float | None = None
    ge: float | None = None

    @model_validator(mode="after")
    def _some_bound(self) -> Range:
        if all(v is None for v in (self.lt, self.le, self.gt, self.ge)):
            raise ValueError("give at least one of lt, le, gt, ge")
        return self

    def holds(self, value: float | None) -> bool:
        """Whether ``value`` lies within every bound."""
        if value is None:
            return False
        return not (
            (self.lt is not None and not value < self.lt)
            or (self.le is not None and not value <= self.le)
            or (self.gt is not None and not value > self.gt)
            or (self.ge is not None and not value >= self.ge)
        )

    def admits_whole_number(self, low: int, high: int) -> bool:
        """Whether some whole number from ``low`` to ``high`` lies within every bound."""
        lows = [_least(self.gt, strict=True), _least(self.ge, strict=False)]
        highs = [_most(self.lt, strict=True), _most(self.le, strict=False)]
        return max(low, *lows) <= min(high, *highs)

    def describe(self) -> str:
        """The bounds as a policy writes them, e.g. ``{gt: 5000000}``."""
        bounds = {"gt": self.gt, "ge": self.ge, "lt": self.lt, "le": self.le}
        return (
            "{" + ", ".join(f"{k}: {_number(v)}" for k, v in bounds.items() if v is not None) + "}"
        )


def _least(bound: float | None, *, strict: bool) -> float:
    """The smallest whole number above (``strict``) or at least ``bound`` (none: -inf)."""
    if bound is None or math.isinf(bound):
        return -math.inf if bound is None else bound
    if math.isnan(bound):  # nothing compares above NaN
        return math.inf
    return math.floor(bound) + 1 if strict else math.ceil(bound)


def _most(bound: float | None, *, strict: bool) -> float:
    """The largest whole number below (``strict``) or at most ``bound`` (none: +inf)."""
    if bound is None or math.isinf(bound):
        return math.inf if bound is None else bound
    if math.isnan(bound):
        return -math.inf
    return math.ceil(bound) - 1 if strict else math.floor(bound)


def _number(value: float) -> str:
    return str(int(value)) if value.is_integer() else str(value)


class TimeWindow(_Strict):
    """``start`` ≤ local time < ``end`` in ``tz``; a window with ``start`` after ``end``
    runs across midnight and belongs to the day it starts on (for ``days``)."""

    start: str
    end: str
    tz: str = "UTC"
    days: list[Weekday] | None = None

    @field_validator("start", "end")
    @classmethod
    def _clock(cls, value: str) -> str:
        if not _CLOCK.fullmatch(value):
            raise ValueError(f"{value!r} is not a 24-hour HH:MM time")
        return value

    @field_validator("tz")
    @classmethod
    def _zone(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {value!r}") from None
        return value

    @model_validator(mode="after")
    def _not_empty(self) -> TimeWindow:
        if self.start == self.end:
            raise ValueError("start equals end: leave time_window out to match all day")
        return self

    def holds(self, when: datetime) -> bool:
        """Whether the aware datetime ``when`` falls inside the window."""
        local = when.astimezone(ZoneInfo(self.tz))
        now, start, end = local.time(), _parse_clock(self.start), _parse_clock(self.end)
        if start < end:
            inside, day = start <= now < end, local
        elif now >= start:
            inside, day = True, local
        else:
            inside, day = now < end, local - timedelta(days=1)
        return inside and (self.days is None or WEEKDAYS[day.weekday()] in self.days)


def _parse_clock(value: str) -> time:
    hours, minutes = value.split(":")
    return time(int(hours), int(minutes))


class LoadCondition(_Strict):
    """A backend's moving-average busy fraction above ``busy_above`` for ``for_s`` seconds."""

    backend: Backend = "gpu"
    busy_above: float = Field(ge=0, lt=1)
    for_s: float = Field(default=0.0, ge=0)


class Match(_Strict):
    """Conditions of a rule; all that are given must hold."""

    path: Globs | None = None
    mode: Annotated[list[Mode], Field(min_length=1)] | None = None
    model: Globs | None = None
    latency_budget_ms: Range | None = None
    priority: Range | None = None
    tenant: Globs | None = None
    tenant_tier: Globs | None = None
    payload_bytes: Range | None = None
    input_elements: Range | None = None
    input_tokens: Range | None = None
    time_window: TimeWindow | None = None
    load: LoadCondition | None = None

    def empty(self) -> bool:
        """Whether the rule has no conditions (matches everything)."""
        return not self.model_fields_set or all(
            getattr(self, name) is None for name in self.model_fields_set
        )


class Spill(_Strict):
    """Send ``share`` of the matching requests to ``to`` instead."""

    share: float = Field(gt=0, le=1)
    to: Backend


class Rule(_Strict):
    """One rule: conditions, a backend, an optional spill and fallback chain."""

    name: RuleName
    description: str = ""
    match: Match = Field(default_factory=Match)
    route: Backend
    spill: Spill | None = None
    fallback: list[Backend] | None = None

    @model_validator(mode="after")
    def _coherent(self) -> Rule:
        if self.spill is not None and self.spill.to == self.route:
            raise ValueError("spill.to must differ from route")
        if self.fallback is not None and self.route in self.fallback:
            raise ValueError("fallback may not contain the routed backend")
        sizes = self.match.payload_bytes
        # A body the router takes is 0 to SYNC_BODY_BYTES long (ROUTER_MAX_BODY_BYTES'
        # default; a larger one is refused 413 before any rule, and no synchronous Lambda
        # event carries more): a size rule outside that range is dead.
        if sizes is not None and not sizes.admits_whole_number(0, SYNC_BODY_BYTES):
            raise ValueError(
                f"rule {self.name!r}: payload_bytes {sizes.describe()} can never match: "
                f"the router takes bodies of 0 to {SYNC_BODY_BYTES:,} bytes and refuses "
                "larger ones (413) before any rule runs"
            )
        return self


class Defaults(_Strict):
    """Values a request has when it does not say."""

    mode: Mode = "auto"
    priority: int = Field(default=2, ge=0)
    tenant_tier: str = "standard"


Keep = Literal["both", "inputs", "outputs"]


class CaptureRule(_Strict):
    """One entry of ``capture``: which requests data capture samples, and what it keeps."""

    model: Glob = "*"
    """Model names (one shell-style glob) the entry applies to."""
    tenant: Glob | None = None
    """Tenants (one glob) it applies to; unset: every tenant, the anonymous one too."""
    sample: float = Field(ge=0, le=1)
    """Share of the matching requests kept: 0 keeps none (an exception to a later entry),
    1 keeps every one."""
    keep: Keep = "both"
    """The request (``inputs``), the answer (``outputs``) or both in each record."""
    errors: bool = True
    """Whether failed requests (4xx, 5xx) are captured too, at the same rate."""

    def holds(self, model: str, tenant: str | None) -> bool:
        """Whether the entry applies to ``model`` called by ``tenant``."""
        if not fnmatchcase(model, self.model):
            return False
        return self.tenant is None or (tenant is not None and fnmatchcase(tenant, self.tenant))

    def catch_all(self) -> bool:
        """Whether the entry applies to every request (later entries never decide)."""
        return self.model == "*" and self.tenant in (None, "*")


def _check_capture(entries: list[CaptureRule]) -> None:
    for index, entry in enumerate(entries[:-1]):
        if entry.catch_all():
            raise ValueError(
                f"capture[{index}] matches every model and tenant, so capture[{index + 1}] "
                "never decides: put the catch-all entry last"
            )


def _default_fallbacks() -> dict[Backend, list[Backend]]:
    return {"gpu": ["cpu"]}


class Policy(_Strict):
    """A whole policy: defaults, tenant tiers, fallback chains and ordered rules."""

    version: Literal[1] = 1
    description: str = ""
    defaults: Defaults = Field(default_factory=Defaults)
    tenants: dict[str, str] = Field(default_factory=dict)
    tier_priorities: dict[str, int] = Field(default_factory=dict)
    """The highest priority (smallest level, 1 first) a tier's callers may use; a request
    asking for more is served at its tier's level. A tier not listed may use any."""
    fallbacks: dict[Backend, list[Backend]] = Field(default_factory=_default_fallbacks)
    rules: list[Rule] = Field(min_length=1)
    capture: list[CaptureRule] = Field(default_factory=list)
    """Data capture: the first entry that applies to a request decides; none: not kept."""

    @model_validator(mode="after")
    def _ordered(self) -> Policy:
        names = [rule.name for rule in self.rules]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"rule names must be unique; repeated: {', '.join(duplicates)}")
        for index, rule in enumerate(self.rules[:-1]):
            if rule.match.empty():
                later = self.rules[index + 1].name
                raise ValueError(f"rule {rule.name!r} matches everything, so {later!r} never fires")
        if not self.rules[-1].match.empty():
            raise ValueError(f"the last rule ({self.rules[-1].name!r}) must have no match")
        for backend, chain in self.fallbacks.items():
            if backend in chain:
                raise ValueError(f"fallbacks.{backend} may not contain {backend}")
        _check_capture(self.capture)
        return self

    def capture_rule(self, model: str, tenant: str | None) -> CaptureRule | None:
        """The ``capture`` entry that decides for ``model`` and ``tenant`` (``None``:
        requests of theirs are not captured)."""
        return next((entry for entry in self.capture if entry.holds(model, tenant)), None)

    def allowed_priority(self, tenant: str | None, requested: int | None) -> int | None:
        """``requested`` as the tenant's tier allows it (0 and ``None``: the default)."""
        floor = self.tier_priorities.get(self.tier_of(tenant))
        if not requested or floor is None:
            return requested
        return max(requested, floor)

    def tier_of(self, tenant: str | None) -> str:
        """The tier of a tenant (the default tier for unknown or absent tenants)."""
        if tenant is None:
            return self.defaults.tenant_tier
        return self.tenants.get(tenant, self.defaults.tenant_tier)

    def chain(self, rule: Rule, primary: Backend) -> tuple[Backend, ...]:
        """The backends to try, in order, when ``primary`` is tried first under ``rule``."""
        fallback = rule.fallback if rule.fallback is not None else self.fallbacks.get(rule.route)
        return _unique([primary, rule.route, *(fallback or [])])


def _unique(items: Iterable[Backend]) -> tuple[Backend, ...]:
    return tuple(dict.fromkeys(items))


def parse_policy(text: str | bytes, source: str = "policy") -> Policy:
    """A validated policy from YAML or JSON text; ``PolicyError`` says what is wrong."""
    data = _load_text(text, source)
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        raise PolicyError(f"{source}: {_summary(exc)}") from None


def _load_text(text: str | bytes, source: str) -> Any:
    raw = text.decode() if isinstance(text, bytes) else text
    if raw.lstrip().startswith("{"):
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise PolicyError(f"{source}: invalid JSON at line {exc.lineno}: {exc.msg}") from None
    import yaml  # only policies written in YAML pay for the import

    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise PolicyError(f"{source}: invalid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise PolicyError(f"{source}: a policy is a mapping with a 'rules' list")
    return data


def _summary(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False, include_context=False, include_input=False)
    parts = [f"{'.'.join(map(str, e['loc'])) or 'policy'}: {e['msg']}" for e in errors[:5]]
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return "; ".join(parts) + more


DEFAULT_POLICY = Policy(
    description="Built-in: everything to the GPU service, the CPU fallback when it fails.",
    rules=[
        Rule(name="batch-requested", match=Match(mode=["batch"]), route="batch"),
        Rule(name="serverless-requested", match=Match(mode=["serverless"]), route="cpu"),
        Rule(name="default", route="gpu"),
    ],
)


def globs_hold(patterns: list[str] | None, value: str | None) -> bool:
    """Whether ``value`` matches one of the shell-style ``patterns`` (case-sensitive)."""
    return patterns is None or (value is not None and any(fnmatchcase(value, p) for p in patterns))


__all__ = [
    "DEFAULT_POLICY",
    "Backend",
    "CaptureRule",
    "Mode",
    "Policy",
    "PolicyError",
    "Rule",
    "parse_policy",
]
