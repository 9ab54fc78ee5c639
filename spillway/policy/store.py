"""Where the policy comes from, and keeping the last good one.

A policy loads from a file (local runs) or an SSM parameter (AWS, read with Powertools
Parameters) and is used for ``ttl_s`` before the source is looked at again, so it can
change without a redeploy. A new text that does not validate is refused: the error is
logged and counted, and the last good policy keeps serving. Only one thread refreshes;
the others keep using the current policy meanwhile.

At start-up a bad *file* is an error (the operator is there to see it); a bad or
unreadable *parameter* leaves the built-in policy serving until a good one appears.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from spillway.policy.rules import DEFAULT_POLICY, Policy, PolicyError, parse_policy

log = logging.getLogger("spillway.router.policy")


class PolicySource(Protocol):
    """Something that returns the current policy text."""

    name: str

    def fetch(self) -> str:
        """The policy text now; raises ``OSError`` (or a client error) when unreadable."""
        ...


class FileSource:
    """A policy file (YAML or JSON)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.name = str(path)

    def fetch(self) -> str:
        """The file's text."""
        return self.path.read_text(encoding="utf-8")


class SsmSource:
    """An SSM parameter, read with Powertools Parameters (imported on first use)."""

    def __init__(self, parameter: str) -> None:
        self.parameter = parameter
        self.name = f"ssm:{parameter}"
        self._provider: Any = None

    def fetch(self) -> str:
        """The parameter's current value, fetched now (the store's TTL is the cache)."""
        if self._provider is None:
            from aws_lambda_powertools.utilities.parameters import SSMProvider

            from spillway.aws.clients import config as aws_config

            config = aws_config(connect_timeout=2, read_timeout=5, max_attempts=2, retry_mode=None)
            self._provider = SSMProvider(boto_config=config)
        # The store's own TTL decides when to ask; when it asks, it wants the fresh value.
        return str(self._provider.get(self.parameter, force_fetch=True))


@dataclass(frozen=True)
class LoadedPolicy:
    """A policy in use, where it came from and a digest of its text."""

    policy: Policy
    source: str
    digest: str


class PolicyStore:
    """The policy in use; refreshed from its source every ``ttl_s`` seconds."""

    def __init__(
        self,
        source: PolicySource | None,
        *,
        ttl_s: float,
        clock: Callable[[], float],
        on_change: Callable[[LoadedPolicy], None] | None = None,
        on_reject: Callable[[str], None] | None = None,
    ) -> None:
        self._source = source
        self._ttl_s = ttl_s
        self._clock = clock
        self._on_change = on_change
        self._on_reject = on_reject
        self._refreshing = threading.Lock()
        self.loaded = LoadedPolicy(DEFAULT_POLICY, "built-in", "")
        self._checked = clock()
        self.rejections = 0
        self.last_error: str | None = None
        if source is not None and not self._refresh() and isinstance(source, FileSource):
            raise PolicyError(self.last_error or f"{source.name}: unreadable")

    @property
    def policy(self) -> Policy:
        """The policy to use now (refreshed first when its TTL has passed)."""
        due = self._source is not None and self._clock() - self._checked >= self._ttl_s
        if due and self._refreshing.acquire(blocking=False):
            try:
                self._refresh()
            finally:
                self._refreshing.release()
        return self.loaded.policy

    def _refresh(self) -> bool:
        """Fetch and install the source's policy; False (and the old one kept) on error."""
        if self._source is None:
            return True
        self._checked = self._clock()
        try:
            text = self._source.fetch()
        except Exception as exc:  # noqa: BLE001 - any client error: keep serving the last good
            return self._reject(f"{self._source.name}: cannot read the policy: {exc}")
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        if digest == self.loaded.digest:
            return True
        try:
            policy = parse_policy(text, self._source.name)
        except PolicyError as exc:
            return self._reject(str(exc))
        self.loaded = LoadedPolicy(policy, self._source.name, digest)
        self.last_error = None
        log.info("policy %s from %s is in use", digest, self._source.name)
        if self._on_change is not None:
            self._on_change(self.loaded)
        return True

    def _reject(self, message: str) -> bool:
        self.rejections += 1
        self.last_error = message
        log.error("policy refused, keeping %s: %s", self.loaded.source, message)
        if self._on_reject is not None:
            self._on_reject(message)
        return False
