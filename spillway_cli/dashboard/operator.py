"""What the operator's stores and services say, read every few seconds for every tenant
(the dashboard is an operator's view: rows that belong to a tenant carry its scope).

* Canaries: each model's record in the routers' state table (``spillway.canary.records``),
  as ``spillway models status`` reads it.
* Served versions: each backend's ``GET /v2/models/{model}`` (the GPU service, the CPU
  fallback); the models are the GPU repository's index and those the router's lines name.
* The policy in force: the file or SSM parameter the router reads, loaded by the router's
  own ``PolicyStore`` (its digest is the version the router logs when it takes a policy).
* The async backlog: the live queued and running records of the async table's pending
  index (``AsyncStore.pending``), oldest first.
* Batch jobs: the newest records of the jobs table, each with the state ``spillway jobs
  status`` reports (Batch's view and the committed shards).
* Process starts: a backend whose health answers after it did not (or the first time it
  answers) started once more; the local stack's CPU fallback is a long-lived process that
  runs no Lambda handler, so this is how its cold starts are counted locally.

A source that cannot be read shows its error in its panel; the others are unaffected.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from spillway.async_inference.settings import AsyncSettings
from spillway.async_inference.store import AsyncStore
from spillway.aws.clients import aws_client
from spillway.canary.records import CanaryState, CanaryStore
from spillway.policy.rules import Policy, Rule
from spillway.policy.store import PolicySource, PolicyStore
from spillway.state import dynamo
from spillway.state.table import DynamoStateStore

Clients = Callable[[str], Any]
HTTP_TIMEOUT_S = 2.0


def _get_json(url: str, method: str = "GET") -> Any:
    """The JSON answer of ``url``; raises ``OSError`` (down, or not a 200) or ``ValueError``."""
    data = b"{}" if method == "POST" else None
    request = urllib.request.Request(url, data=data, method=method)  # noqa: S310 - our own setting
    request.add_header("content-type", "application/json")
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:  # noqa: S310
        return json.loads(response.read())


def _answers(url: str) -> bool:
    """Whether ``url`` answers 200 (whatever its body)."""
    try:
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as response:  # noqa: S310
            return int(response.status) == 200
    except (OSError, ValueError):
        return False


def _failed(exc: Exception) -> dict[str, Any]:
    return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def canary_view(state: CanaryState) -> dict[str, Any]:
    """A canary record as the page shows it."""
    last = state.history[-1] if state.history else None
    return {
        "stable": state.stable,
        "canary": state.canary,
        "percent": state.percent,
        "status": state.status,
        "running": state.running,
        "rolled_back": list(state.rolled_back),
        "last_event": last.event if last else None,
        "last_reason": last.reason if last else "",
    }


def rule_view(rule: Rule) -> dict[str, Any]:
    """One rule of the policy in force: its name, what it matches, where it routes."""
    matches = rule.match.model_dump(exclude_none=True)
    return {
        "name": rule.name,
        "match": ", ".join(f"{k}={_short(v)}" for k, v in matches.items()) or "any request",
        "route": rule.route,
        "spill": f"{rule.spill.share:.0%} to {rule.spill.to}" if rule.spill else "",
        "fallback": ", ".join(rule.fallback) if rule.fallback is not None else "",
    }


def _short(value: Any) -> str:
    text = json.dumps(value, separators=(",", ":")) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


def policy_view(policy: Policy, source: str, digest: str) -> dict[str, Any]:
    """The policy in force: where it comes from, its version (digest) and rules in order."""
    return {
        "source": source,
        "digest": digest,
        "description": policy.description,
        "rules": [rule_view(rule) for rule in policy.rules],
        "fallbacks": {k: list(v) for k, v in policy.fallbacks.items()},
    }


def backlog_view(records: Iterable[Any], now: float, limit: int) -> dict[str, Any]:
    """The async backlog from the pending records (oldest first), per tenant too."""
    pending = list(records)
    per_tenant: Counter[str] = Counter(r.tenant for r in pending)
    states: Counter[str] = Counter(str(r.state) for r in pending)
    oldest = min((r.created_at for r in pending), default=None)
    return {
        "pending": len(pending),
        "queued": states.get("queued", 0),
        "running": states.get("running", 0),
        "oldest_age_s": None if oldest is None else max(0.0, now - oldest),
        "tenants": dict(sorted(per_tenant.items())),
        "capped": len(pending) >= limit,
    }


def _created(record: dict[str, Any]) -> float:
    try:
        return datetime.fromisoformat(str(record.get("created_at"))).timestamp()
    except ValueError:
        return 0.0


@dataclass
class Operator:
    """The operator's sources; ``None`` parts are not shown."""

    state_table: str | None = None
    policy: PolicySource | None = None
    backends: dict[str, str] = field(default_factory=dict)
    """Backend name → base URL (``gpu``, ``cpu``)."""
    async_settings: AsyncSettings | None = None
    jobs_table: str | None = None
    jobs_status: Callable[[str], Any] | None = None
    """A job id → its status (``JobService.status_as_operator``); ``None``: the record's
    own state."""
    clients: Clients = aws_client
    clock: Callable[[], float] = time.time
    jobs_shown: int = 10
    jobs_scanned: int = 1000
    """Most job records read per round (newest shown first among them)."""
    backlog_limit: int = 1000
    """Most pending async records counted per round (the page says when it is capped)."""
    starts: dict[str, int] = field(default_factory=dict)
    _up: dict[str, bool] = field(default_factory=dict)
    _canaries: CanaryStore | None = None
    _async: AsyncStore | None = None

    def read(self, models: Iterable[str]) -> dict[str, Any]:
        """One round over every source."""
        starts = self._read_starts()  # first: a backend that is down is not asked more
        names = set(models) | self._indexed_models()
        return {
            "models": sorted(names),
            "canaries": self._read_canaries(names),
            "versions": self._read_versions(names),
            "policy": self._read_policy(),
            "async": self._read_backlog(),
            "jobs": self._read_jobs(),
            "process_starts": starts,
        }

    def _indexed_models(self) -> set[str]:
        url = self.backends.get("gpu")
        if url is None or not self._up.get("gpu"):
            return set()
        try:
            rows = _get_json(f"{url}/v2/repository/index", "POST")
        except (OSError, ValueError):
            return set()
        return {str(r["name"]) for r in rows if isinstance(r, dict) and r.get("name")}

    def _read_canaries(self, models: set[str]) -> dict[str, Any] | None:
        if self.state_table is None:
            return None
        if self._canaries is None:
            table = DynamoStateStore(self.state_table, lambda: self.clients("dynamodb"))
            self._canaries = CanaryStore(table, self.clock)
        found: dict[str, Any] = {}
        try:
            for model in sorted(models):
                state = self._canaries.load(model)
                if state is not None:
                    found[model] = canary_view(state)
        except Exception as exc:  # noqa: BLE001 - any client error is the panel's to show
            return _failed(exc)
        return {"models": found}

    def _read_versions(self, models: set[str]) -> dict[str, dict[str, Any]]:
        versions: dict[str, dict[str, Any]] = {}
        for backend, url in sorted(self.backends.items()):
            for model in sorted(models):
                if not self._up.get(backend):
                    versions.setdefault(model, {})[backend] = "not answering"
                    continue
                quoted = urllib.parse.quote(model, safe="")
                try:
                    document = _get_json(f"{url}/v2/models/{quoted}")
                    served: Any = [str(v) for v in document.get("versions") or []]
                except urllib.error.HTTPError as exc:
                    served = "not served" if exc.code == 404 else f"HTTP {exc.code}"
                except (OSError, ValueError, AttributeError):
                    served = "not answering"
                versions.setdefault(model, {})[backend] = served
        return versions

    def _read_policy(self) -> dict[str, Any] | None:
        if self.policy is None:
            return None
        try:
            store = PolicyStore(self.policy, ttl_s=0, clock=self.clock)
        except Exception as exc:  # noqa: BLE001 - a bad file or an unreadable parameter
            return _failed(exc)
        if store.last_error is not None:
            return {"error": store.last_error}
        loaded = store.loaded
        return policy_view(loaded.policy, loaded.source, loaded.digest)

    def _read_backlog(self) -> dict[str, Any] | None:
        if self.async_settings is None or not self.async_settings.enabled:
            return None
        try:
            if self._async is None:
                self._async = AsyncStore(self.async_settings, clients=self.clients)
            pending = self._async.pending(self.backlog_limit)
            return backlog_view(pending, self.clock(), self.backlog_limit)
        except Exception as exc:  # noqa: BLE001 - any client error is the panel's to show
            return _failed(exc)

    def _read_jobs(self) -> dict[str, Any] | None:
        if self.jobs_table is None:
            return None
        try:
            records = self._job_records()
        except Exception as exc:  # noqa: BLE001 - any client error is the panel's to show
            return _failed(exc)
        newest = sorted(records, key=_created, reverse=True)[: self.jobs_shown]
        rows = [self._job_row(record) for record in newest]
        states: Counter[str] = Counter(row["state"] for row in rows)
        return {"total": len(records), "rows": rows, "states": dict(sorted(states.items()))}

    def _job_records(self) -> list[dict[str, Any]]:
        """Up to ``jobs_scanned`` records of the jobs table (every tenant's)."""
        client = self.clients("dynamodb")
        query: dict[str, Any] = {
            "TableName": self.jobs_table,
            "ProjectionExpression": "job_id, created_at, #o, #s, model",
            "ExpressionAttributeNames": {"#o": "owner", "#s": "state"},
        }
        records: list[dict[str, Any]] = []
        while len(records) < self.jobs_scanned:
            answer = client.scan(**query, Limit=self.jobs_scanned - len(records))
            records += [dynamo.plain_item(item) for item in answer.get("Items") or []]
            if "LastEvaluatedKey" not in answer:
                break
            query["ExclusiveStartKey"] = answer["LastEvaluatedKey"]
        return records

    def _job_row(self, record: dict[str, Any]) -> dict[str, Any]:
        state = str(record.get("state"))
        if self.jobs_status is not None:
            with contextlib.suppress(Exception):  # the record's own state stands
                state = str(self.jobs_status(str(record["job_id"])).state)
        return {
            "job_id": str(record.get("job_id")),
            "tenant_scope": str(record.get("owner", "-")),
            "model": str(record.get("model", "-")),
            "state": state,
            "created_at": str(record.get("created_at", "")),
        }

    def _read_starts(self) -> dict[str, int]:
        """Count a start each time a backend's health answers after it did not."""
        for backend, url in sorted(self.backends.items()):
            up = _answers(f"{url}/v2/health/live")
            if up and not self._up.get(backend, False):
                self.starts[backend] = self.starts.get(backend, 0) + 1
            self._up[backend] = up
        return dict(self.starts)
