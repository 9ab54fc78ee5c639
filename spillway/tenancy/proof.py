"""Tenant scopes a backend can trust: signed by the router, verified by every backend.

A tenant scope (``spillway.state.table.scope``) is a digest of the tenant's name, so any
client that reaches a backend could compute another tenant's and claim it. What the
router vouches for therefore travels as ``<scope>.<expiry>.<signature>``
(``spillway.protocol.wire.TENANT_SCOPE_HEADER``): the signature is HMAC-SHA256 over the
scope and the expiry (epoch seconds), keyed with a secret that only the router and the
backends may read, in AWS Secrets Manager. A backend keys a tenant's pipeline step cache
entries by the scope only when the signature verifies with a key it holds and the expiry
has not passed; anything else (no value, a bare scope, a wrong, rotated-out or expired
proof) is *unproven*: served, with no tenant's cache at all (no reads, no writes), so a
hit never tells a direct client what another caller sent. Steps a pipeline declares
``cache_scope: "shared"`` read only public inputs and report no hits: they stay shared.

Keys and rotation. The secret's ``AWSCURRENT`` version signs; ``AWSCURRENT`` and
``AWSPREVIOUS`` verify. Rotating (``put-secret-value``, or a rotation function) makes the
new version ``AWSCURRENT`` and the old one ``AWSPREVIOUS``, so a scope signed with the old
key still verifies while signers pick the new one up; a key two rotations old is
``AWSPREVIOUS`` no longer and verifies nothing
(https://docs.aws.amazon.com/secretsmanager/latest/userguide/rotating-secrets.html). Every
process reads the versions through ``SecretKeys``, cached for ``refresh_s``: a backend
that has not yet read a fresh ``AWSCURRENT`` treats the new proofs as unproven for at
most that long (a cache miss, never a wrong answer). A failed read keeps the keys held
and tries again after ``RETRY_S``.

A proof is a bearer token for ``ttl_s``: it lets its holder use that tenant's cache only
through a backend's private port, and only until it expires.

``ProofSettings`` come from ``SCOPE_PROOF_*`` variables, read alike by the router, the
GPU service and the CPU fallback.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from spillway.envsettings import prefixed_values
from spillway.protocol.wire import read_scope_claim

log = logging.getLogger("spillway.tenancy.proof")

ENV_PREFIX = "SCOPE_PROOF_"
CURRENT, PREVIOUS = "AWSCURRENT", "AWSPREVIOUS"
MIN_KEY_CHARS = 32
"""A secret shorter than this is no key (the templates generate 64 characters)."""
MAX_TTL_S = 3600
MAX_SKEW_S = 60
"""How far ahead of the verifier's clock a signer's may run: an expiry further out than
``MAX_TTL_S`` plus this is refused as no proof the router would make."""
RETRY_S = 10.0
"""After a failed read of the secret, the next try waits this long (or ``refresh_s``)."""
_CONTEXT = b"spillway-tenant-scope/v1"


class ProofSettings(BaseModel):
    """The tenant scope proof (``SCOPE_PROOF_<FIELD>``); the router, the GPU service and
    the CPU fallback read the same variables."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    secret_id: str | None = None
    """Secrets Manager secret (name or ARN) whose ``AWSCURRENT`` version signs scopes and
    whose ``AWSCURRENT`` and ``AWSPREVIOUS`` versions verify them. Unset: no key, so the
    router's scopes carry no proof and a backend proves none (no tenant step cache)."""
    refresh_s: float = Field(default=300.0, ge=1, le=3600)
    """How long the keys read from the secret are used before they are read again: a
    rotation reaches every process within this."""
    ttl_s: int = Field(default=300, ge=10, le=MAX_TTL_S)
    """How long a scope the router signs stays valid (it signs one per request)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ProofSettings:
        """Settings from ``SCOPE_PROOF_*`` variables (empty values count as unset)."""
        return cls.model_validate(prefixed_values(cls, ENV_PREFIX, environ))


@dataclass(frozen=True)
class KeyRing:
    """The keys held now: ``current`` signs; ``current`` and ``previous`` verify."""

    current: bytes | None = None
    previous: bytes | None = None

    @property
    def verifying(self) -> tuple[bytes, ...]:
        return tuple(k for k in (self.current, self.previous) if k is not None)


class KeySource(Protocol):
    """Where the keys come from."""

    def ring(self) -> KeyRing:
        """The keys, read again first when due (may block on the network)."""
        ...

    def ring_nowait(self) -> KeyRing:
        """The keys held now, never blocking (a due read runs in the background)."""
        ...


@dataclass(frozen=True)
class StaticKeys:
    """A fixed key ring (unit tests; a process given its keys some other way)."""

    keys: KeyRing

    def ring(self) -> KeyRing:
        return self.keys

    def ring_nowait(self) -> KeyRing:
        return self.keys


def _key(secret_string: str | None) -> bytes | None:
    if secret_string is None:
        return None
    if len(secret_string) < MIN_KEY_CHARS:
        log.error("the scope proof secret is shorter than %d characters: not used", MIN_KEY_CHARS)
        return None
    return secret_string.encode("utf-8")


class SecretKeys:
    """The ``AWSCURRENT`` and ``AWSPREVIOUS`` versions of a Secrets Manager secret,
    cached for ``refresh_s``; one read at a time (thread-safe). ``ring_nowait`` never
    waits for a read, not even one in progress."""

    def __init__(
        self,
        secret_id: str,
        client: Callable[[], Any],
        *,
        refresh_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.secret_id = secret_id
        self._client = client
        self._refresh_s = refresh_s
        self._clock = clock
        self._keys = KeyRing()
        self._due = -math.inf
        self._read_lock = threading.Lock()  # held for a whole read: one at a time
        self._flag_lock = threading.Lock()  # guards _reading alone, never held for a read
        self._reading = False

    def ring(self) -> KeyRing:
        self._read_if_due()
        return self._keys

    def ring_nowait(self) -> KeyRing:
        if self._clock() >= self._due:
            with self._flag_lock:
                start, self._reading = not self._reading, True
            if start:
                threading.Thread(target=self._read_aside, name="scope-keys", daemon=True).start()
        return self._keys

    def _read_if_due(self) -> None:
        if self._clock() >= self._due:
            with self._read_lock:
                if self._clock() >= self._due:  # another thread may have read meanwhile
                    self._read()

    def _read_aside(self) -> None:
        try:
            self._read_if_due()
        finally:
            with self._flag_lock:
                self._reading = False

    def _read(self) -> None:
        """Read both versions (lock held); a failure keeps the keys held."""
        from spillway.aws.errors import aws_errors

        now = self._clock()
        try:
            client = self._client()
            current = self._version(client, CURRENT)
            previous = self._version(client, PREVIOUS)
        except aws_errors() as exc:
            log.warning("scope proof keys not read (kept what is held): %s", exc)
            self._due = now + min(RETRY_S, self._refresh_s)
            return
        self._keys = KeyRing(_key(current), _key(previous))
        self._due = now + self._refresh_s

    def _version(self, client: Any, stage: str) -> str | None:
        """The secret's text at ``stage``; ``None`` when no version has that label (a
        secret never rotated has no ``AWSPREVIOUS``)."""
        # GetSecretValue with VersionStage: https://docs.aws.amazon.com/secretsmanager/latest/apireference/API_GetSecretValue.html
        try:
            answer = client.get_secret_value(SecretId=self.secret_id, VersionStage=stage)
        except client.exceptions.ResourceNotFoundException:
            if stage == CURRENT:
                raise
            return None
        text = answer.get("SecretString")
        return text if isinstance(text, str) else None


def _secrets_client() -> Callable[[], Any]:
    """Makes boto3's Secrets Manager client once, with short timeouts: a router reads the
    keys on a request's thread (a failed read keeps the keys held, so it must not wait
    long)."""
    made: list[Any] = []

    def client() -> Any:
        if not made:
            from spillway.aws.clients import client as aws_client

            made.append(
                aws_client("secretsmanager", connect_timeout=1, read_timeout=2, max_attempts=2)
            )
        return made[0]

    return client


def _signature(key: bytes, scope: str, expiry: int) -> str:
    message = b"%s\n%s\n%d" % (_CONTEXT, scope.encode("ascii"), expiry)
    return hmac.new(key, message, hashlib.sha256).hexdigest()


class ScopeProofs:
    """Signs scopes (the router) and verifies them (the backends) with ``keys``.

    ``wait``: whether a due read of the keys may block the caller (a Lambda handler's
    thread may; an event loop may not, and reads in the background instead)."""

    def __init__(
        self,
        keys: KeySource | None,
        *,
        ttl_s: int = 300,
        wall: Callable[[], float] = time.time,
        wait: bool = True,
    ) -> None:
        self.keys = keys
        self.ttl_s = ttl_s
        self._wall = wall
        self._wait = wait

    @classmethod
    def from_settings(
        cls,
        settings: ProofSettings,
        client: Callable[[], Any] | None = None,
        *,
        wait: bool = True,
    ) -> ScopeProofs:
        """Proofs keyed by the secret ``settings`` name (none: nothing is ever proven);
        ``client`` makes the Secrets Manager client (default: boto3's, made once)."""
        if settings.secret_id is None:
            log.warning("SCOPE_PROOF_SECRET_ID is unset: tenant scopes are never proven")
            return cls(None, ttl_s=settings.ttl_s, wait=wait)
        keys = SecretKeys(
            settings.secret_id, client or _secrets_client(), refresh_s=settings.refresh_s
        )
        return cls(keys, ttl_s=settings.ttl_s, wait=wait)

    @classmethod
    def from_env(cls, *, wait: bool = True) -> ScopeProofs:
        """``from_settings`` of the ``SCOPE_PROOF_*`` variables."""
        return cls.from_settings(ProofSettings.from_env(), wait=wait)

    def _ring(self) -> KeyRing:
        if self.keys is None:
            return KeyRing()
        return self.keys.ring() if self._wait else self.keys.ring_nowait()

    def prime(self) -> bool:
        """Read the keys now (blocking; at start-up); whether a verifying key is held."""
        return bool(self.keys is not None and self.keys.ring().verifying)

    def sign(self, scope: str) -> str:
        """``<scope>.<expiry>.<signature>``, valid for ``ttl_s``; without a key, the bare
        scope (which every backend serves as unproven)."""
        key = self._ring().current
        if key is None:
            return scope
        expiry = math.ceil(self._wall()) + self.ttl_s
        return f"{scope}.{expiry}.{_signature(key, scope, expiry)}"

    def verify(self, value: str | None) -> str | None:
        """The scope ``value`` proves, or ``None`` when it proves none (absent, bare,
        expired, or not signed with a key held now); a value that is not a scope claim
        at all is refused (``InvalidInputError``, 400)."""
        claim = read_scope_claim(value)
        if claim is None or claim.expiry is None or claim.signature is None:
            return None
        now = self._wall()
        if not now <= claim.expiry <= now + MAX_TTL_S + MAX_SKEW_S:
            return None
        for key in self._ring().verifying:
            expected = _signature(key, claim.scope, claim.expiry)
            if hmac.compare_digest(expected, claim.signature):
                return claim.scope
        return None
