"""Live configuration: who each identity is and the log level, changed without a deploy.

One item of the state table (key ``config#live``) holds the identity → tenant map and the
log level; every function that serves callers (the router, the WebSocket function, the
jobs function and the CPU fallback) reads it at most every ``ttl_s`` seconds, so a tenant
added or removed with ``spillway tenants`` reaches every door within that time, and none
needs a deploy. Lambda's environment would hold about 40 IAM-ARN tenants in its 4 KB and
make each new tenant a deploy; one DynamoDB item holds thousands (400 KB), one
``GetItem`` a container per TTL.

Rules:

- a function's static map (``ROUTER_IDENTITY_TENANTS``, ``JOBS_IDENTITY_TENANTS``) is the
  base the table's entries add to or override; the deployed templates set none, so there
  the table is the one source;
- until the first read succeeds, a lookup is ``StateUnavailableError`` (503), never a
  guess: an unmapped identity would otherwise become a tenant of its own;
- a failed refresh keeps the last good configuration (logged) and is tried again at the
  next lookup after ``retry_s``; only one thread refreshes, the others read the current one.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from spillway.aws.limits import DYNAMODB_ITEM_BYTES
from spillway.protocol.errors import InvalidInputError, StateUnavailableError, UnavailableError
from spillway.state.table import StateStore
from spillway.tenancy.identity import tenant_hint

log = logging.getLogger("spillway.tenancy")

CONFIG_KEY = "config#live"
"""The state table's item that holds the live configuration."""
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_SETTING = re.compile(r"^[A-Z][A-Z0-9_]{1,127}$")
IDENTITY_MAX_CHARS = 2048
"""An identity is an API key id (10 characters) or an IAM principal ARN (at most 2,048)."""
CONFIG_MAX_BYTES = DYNAMODB_ITEM_BYTES - 4 * 1024
"""The configuration document's JSON, kept below DynamoDB's item size with room for the
item's key and revision."""


@dataclass(frozen=True)
class LiveConfig:
    """The configuration in use: the identity map, the log level (``None``: the
    function's own), settings given over the functions' environment (by variable name;
    each function takes only those it can change live, ``overrides``) and the item's
    revision (0: never written)."""

    identities: dict[str, str] = field(default_factory=dict)
    log_level: str | None = None
    revision: int = 0
    settings: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any], revision: int) -> LiveConfig:
        """The configuration a stored document holds (checked as a write would be)."""
        identities = doc.get("identities") or {}
        if not isinstance(identities, dict):
            raise InvalidInputError("identities must be an object")
        for identity, tenant in identities.items():
            check_identity(identity)
            if not isinstance(tenant, str) or tenant_hint(tenant) is None:
                raise InvalidInputError(f"identity {identity!r} maps to no tenant")
        level = doc.get("log_level")
        settings = doc.get("settings") or {}
        if not isinstance(settings, dict):
            raise InvalidInputError("settings must be an object")
        for name, value in settings.items():
            check_setting(name, value)
        return cls(
            dict(identities), check_log_level(level) if level else None, revision, dict(settings)
        )

    def doc(self) -> dict[str, Any]:
        """The document stored for this configuration."""
        return {
            "identities": dict(sorted(self.identities.items())),
            "log_level": self.log_level,
            "settings": dict(sorted(self.settings.items())),
        }

    def overrides(self, names: Collection[str]) -> dict[str, str]:
        """The settings of ``names`` this configuration gives (by variable name)."""
        return {name: value for name, value in self.settings.items() if name in names}


def check_identity(identity: object) -> str:
    """An identity as the map keys it: an API key id or an IAM principal ARN."""
    if not isinstance(identity, str) or not 1 <= len(identity) <= IDENTITY_MAX_CHARS:
        raise InvalidInputError(f"an identity is 1-{IDENTITY_MAX_CHARS} characters")
    if any(ch.isspace() or not ch.isprintable() for ch in identity):
        raise InvalidInputError("an identity has no spaces or control characters")
    return identity


def check_setting(name: object, value: object) -> None:
    """A setting as the configuration holds it: a variable name and a short text."""
    if not isinstance(name, str) or not _SETTING.fullmatch(name):
        raise InvalidInputError(f"{name!r} is not a setting's variable name")
    if not isinstance(value, str) or len(value) > 1024:
        raise InvalidInputError(f"{name}: a setting's value is a text of at most 1024 characters")


def check_log_level(level: object) -> str:
    """A log level name (any case) as ``logging`` spells it."""
    name = str(level).upper()
    if name not in LOG_LEVELS:
        raise InvalidInputError(f"log level must be one of {', '.join(LOG_LEVELS)}")
    return name


class LiveConfigCache:
    """The live configuration, read from the state table at most every ``ttl_s``.

    ``base`` is the function's static identity map, under the table's entries; ``store``
    ``None``: no table, the base is the map for good. Each of ``listeners`` (and of those
    ``subscribe`` adds) is called, on the refreshing thread, with each new configuration."""

    def __init__(
        self,
        store: StateStore | None,
        *,
        ttl_s: float,
        base: Mapping[str, str] | None = None,
        retry_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        listeners: Iterable[Callable[[LiveConfig], None]] = (),
    ) -> None:
        self._store = store
        self._ttl_s = ttl_s
        self._retry_s = min(retry_s, ttl_s) if ttl_s > 0 else retry_s
        self._clock = clock
        self._wall = wall
        self.listeners = list(listeners)
        self._refreshing = threading.Lock()
        self._base = dict(base or {})
        self._config: LiveConfig | None = LiveConfig(dict(self._base)) if store is None else None
        self._due = clock()
        self.failures = 0

    def current(self) -> LiveConfig:
        """The configuration to use now (read first when due); ``StateUnavailableError``
        while it has never been read."""
        if self._store is not None and self._clock() >= self._due:
            blocking = self._config is None
            if self._refreshing.acquire(blocking=blocking):
                try:
                    if self._config is None or self._clock() >= self._due:
                        self._refresh(self._store)
                finally:
                    self._refreshing.release()
        if self._config is None:
            raise StateUnavailableError(
                "the tenant configuration could not be read yet", retry_after_s=self._retry_s
            )
        return self._config

    def poll(self) -> None:
        """Read the configuration when due, for its log level; an unreadable table is
        logged (and tried again) here, and refused only where a tenant is looked up."""
        with contextlib.suppress(UnavailableError):
            self.current()

    def _refresh(self, store: StateStore) -> None:
        try:
            found = store.get(CONFIG_KEY, self._wall())
            stored = LiveConfig.from_doc(found.doc, found.revision) if found else LiveConfig()
        except (UnavailableError, InvalidInputError) as exc:
            self.failures += 1
            self._due = self._clock() + self._retry_s
            log.error("live configuration not read, keeping the last: %s", exc)
            return
        self._due = self._clock() + self._ttl_s
        fresh = replace(stored, identities={**self._base, **stored.identities})
        if fresh == self._config:
            return
        self._config = fresh
        log.info(
            "live configuration revision %d: %d identities, log level %s",
            fresh.revision,
            len(fresh.identities),
            fresh.log_level or "unchanged",
        )
        for listener in self.listeners:
            listener(fresh)

    def subscribe(self, listener: Callable[[LiveConfig], None]) -> None:
        """Call ``listener`` with each new configuration (at once with the current one,
        when it has been read)."""
        self.listeners.append(listener)
        if self._config is not None:
            listener(self._config)


class TenantDirectory(Mapping[str, str]):
    """The identity → tenant map of a ``LiveConfigCache``, as ``Authenticator`` and the
    router read it (``directory.get(identity, identity)``), current at each lookup."""

    def __init__(self, live: LiveConfigCache) -> None:
        self.live = live

    def __getitem__(self, identity: str) -> str:
        return self.live.current().identities[identity]

    def __iter__(self) -> Iterator[str]:
        return iter(self.live.current().identities)

    def __len__(self) -> int:
        return len(self.live.current().identities)


def apply_log_level(config: LiveConfig, *loggers: Any) -> None:
    """Set the configuration's log level (when it names one) on the ``spillway`` logger
    and on each of ``loggers`` (Powertools ``Logger`` or ``logging.Logger``)."""
    if config.log_level is None:
        return
    logging.getLogger("spillway").setLevel(config.log_level)
    for logger in loggers:
        logger.setLevel(config.log_level)


# --- writing (``spillway tenants``, ``spillway config``) ---------------------------------


class ConfigWriter:
    """Changes to the live configuration, each an optimistic write of the one item (a
    concurrent writer's change is read again and kept)."""

    def __init__(self, store: StateStore, wall: Callable[[], float] = time.time) -> None:
        self.store = store
        self.wall = wall

    def read(self) -> LiveConfig:
        """The stored configuration (empty when never written)."""
        found = self.store.get(CONFIG_KEY, self.wall())
        return LiveConfig.from_doc(found.doc, found.revision) if found else LiveConfig()

    def change(self, edit: Callable[[LiveConfig], LiveConfig], attempts: int = 8) -> LiveConfig:
        """Apply ``edit`` to the stored configuration and write it; the written one."""
        import json

        for _ in range(attempts):
            current = self.read()
            wanted = edit(current)
            doc = wanted.doc()
            size = len(json.dumps(doc, separators=(",", ":")).encode())
            if size > CONFIG_MAX_BYTES:
                raise InvalidInputError(
                    f"the configuration would be {size:,} bytes, over the {CONFIG_MAX_BYTES:,} "
                    "a DynamoDB item leaves it: map principals to fewer tenants (an "
                    "authorizer can name the tenant instead)"
                )
            if current.revision == 0:
                written = self.store.create(CONFIG_KEY, doc, self.wall(), None)
            else:
                written = self.store.replace(CONFIG_KEY, doc, current.revision, None)
            if written:
                return replace(wanted, revision=current.revision + 1)
        raise UnavailableError("the configuration kept changing under this write; try again")

    def add(self, identity: str, tenant: str) -> LiveConfig:
        """Map ``identity`` to ``tenant`` (replacing its tenant if it had one)."""
        check_identity(identity)
        if tenant_hint(tenant) is None:
            raise InvalidInputError("a tenant is 1-128 letters, digits or ._:@-")
        return self.change(lambda c: replace(c, identities={**c.identities, identity: tenant}))

    def remove(self, identity: str) -> LiveConfig:
        """Forget ``identity``'s tenant (``KeyError`` when it had none)."""
        if identity not in self.read().identities:
            raise KeyError(identity)
        return self.change(
            lambda c: replace(
                c, identities={k: v for k, v in c.identities.items() if k != identity}
            )
        )

    def set_log_level(self, level: str | None) -> LiveConfig:
        """Set the functions' log level (``None``: each function's own)."""
        name = check_log_level(level) if level else None
        return self.change(lambda c: replace(c, log_level=name))

    def set_setting(self, name: str, value: str | None) -> LiveConfig:
        """Give setting ``name`` (a variable name, e.g. ``ROUTER_DEFAULT_DEADLINE_MS``)
        ``value`` over the functions' environment (``None``: their own again)."""
        if value is None:
            return self.change(
                lambda c: replace(c, settings={k: v for k, v in c.settings.items() if k != name})
            )
        check_setting(name, value)
        return self.change(lambda c: replace(c, settings={**c.settings, name: value}))
