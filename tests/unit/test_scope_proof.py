"""The tenant scope proof (``spillway.tenancy.proof``): what the router signs, every
backend verifies; clocks injected, Secrets Manager as an in-memory fake with AWS's
version labels (its real behaviour on moto: tests/integration/test_step_cache_tenants.py).
"""

from __future__ import annotations

import hashlib
import re
import secrets
import threading
from types import SimpleNamespace
from typing import Any

import pytest
from botocore.exceptions import ClientError

from spillway.protocol.errors import InvalidInputError
from spillway.protocol.wire import TENANT_SCOPE_HEADER, read_scope_claim
from spillway.state.table import scope
from spillway.tenancy.proof import (
    MAX_SKEW_S,
    MAX_TTL_S,
    RETRY_S,
    KeyRing,
    ProofSettings,
    ScopeProofs,
    SecretKeys,
    StaticKeys,
)

NOW = 1_800_000_000.0
ACME, GLOBEX = scope("acme"), scope("globex")
KEY_ARN = "arn:aws:secretsmanager:us-east-1:123456789012:secret:spillway-scope-proof-AbC123"


def _key() -> bytes:
    return secrets.token_hex(32).encode()  # a test's own key, generated


class Clock:
    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def proofs(ring: KeyRing, clock: Clock | None = None, ttl_s: int = 300) -> ScopeProofs:
    return ScopeProofs(StaticKeys(ring), ttl_s=ttl_s, wall=clock or Clock())


def test_a_signed_scope_verifies_until_it_expires() -> None:
    # GIVEN a router and a backend holding the same key, on one clock
    key, clock = _key(), Clock()
    router = proofs(KeyRing(key), clock)
    backend = proofs(KeyRing(key), clock)
    # WHEN the router signs acme's scope
    signed = router.sign(ACME)
    # THEN it is <scope>.<expiry>.<hmac hex>, expiring ttl_s from now, and it proves acme
    assert re.fullmatch(rf"{ACME}\.{int(NOW) + 300}\.[0-9a-f]{{64}}", signed)
    assert backend.verify(signed) == ACME
    # AND the anonymous scope is signed and proven alike
    assert backend.verify(router.sign("-")) == "-"
    # AND it still proves acme at its expiry, and nothing a second later
    clock.now = NOW + 300
    assert backend.verify(signed) == ACME
    clock.now = NOW + 301
    assert backend.verify(signed) is None


def test_anything_but_a_valid_proof_proves_nothing() -> None:
    key = _key()
    backend = proofs(KeyRing(key))
    signed = proofs(KeyRing(key)).sign(ACME)
    _, expiry, signature = signed.split(".")
    for_globex = proofs(KeyRing(key)).sign(GLOBEX)
    claims = {
        "absent": None,
        "the bare scope": ACME,
        "sha256 of the name, as anyone computes it": hashlib.sha256(b"acme").hexdigest()[:32],
        "another tenant's proof on acme's scope": ACME + for_globex.removeprefix(GLOBEX),
        "acme's proof on another scope": f"{GLOBEX}.{expiry}.{signature}",
        "a later expiry": f"{ACME}.{int(expiry) + 1}.{signature}",
        "one signature digit changed": signed[:-1] + ("0" if signed[-1] != "0" else "1"),
        "another key": proofs(KeyRing(_key())).sign(ACME),
        "a proof of a far future": proofs(KeyRing(key), ttl_s=MAX_TTL_S + MAX_SKEW_S + 1).sign(
            ACME
        ),
    }
    # WHEN a backend verifies each; THEN none proves a scope
    assert {what: backend.verify(value) for what, value in claims.items()} == dict.fromkeys(claims)
    # AND the genuine one does
    assert backend.verify(signed) == ACME


@pytest.mark.parametrize(
    "value", ["tenant-a", "x", ACME.upper(), f"{ACME}.1", f"{ACME}.1.{'0' * 63}", f"{ACME}\n", ""]
)
def test_a_value_that_is_no_scope_claim_is_refused(value: str) -> None:
    # WHEN a door reads a value that is not a scope, with or without a proof
    with pytest.raises(InvalidInputError) as refused:
        proofs(KeyRing(_key())).verify(value)
    # THEN it is the caller's error (400 invalid_input), naming the header
    assert (refused.value.status, refused.value.code) == (400, "invalid_input")
    assert TENANT_SCOPE_HEADER in refused.value.message


def test_the_claim_is_taken_apart() -> None:
    assert read_scope_claim(None) is None
    assert read_scope_claim("-") == read_scope_claim("-")
    claim = read_scope_claim(f"{ACME}.123.{'ab' * 32}")
    assert claim is not None
    assert (claim.scope, claim.expiry, claim.signature) == (ACME, 123, "ab" * 32)


def test_without_a_key_nothing_is_signed_or_proven() -> None:
    # GIVEN a router and a backend with no key (SCOPE_PROOF_SECRET_ID unset)
    keyless = ScopeProofs(None, wall=Clock())
    # THEN the router sends the bare scope, and no signed value proves anything
    assert keyless.sign(ACME) == ACME
    assert keyless.verify(proofs(KeyRing(_key())).sign(ACME)) is None
    assert keyless.prime() is False


def test_the_previous_key_verifies_and_one_two_rotations_old_does_not() -> None:
    # GIVEN three keys, rotated twice: the backend holds AWSCURRENT and AWSPREVIOUS
    oldest, previous, current = _key(), _key(), _key()
    backend = proofs(KeyRing(current, previous))
    # THEN scopes signed with either verify, and one signed with the oldest does not
    assert backend.verify(proofs(KeyRing(current)).sign(ACME)) == ACME
    assert backend.verify(proofs(KeyRing(previous)).sign(ACME)) == ACME
    assert backend.verify(proofs(KeyRing(oldest)).sign(ACME)) is None
    # AND the router signs with AWSCURRENT only
    signed = proofs(KeyRing(current, previous)).sign(ACME)
    assert proofs(KeyRing(current)).verify(signed) == ACME


class _NotFound(ClientError):  # type: ignore[misc]  # botocore ships no types
    pass


class FakeSecrets:
    """GetSecretValue by version label, as Secrets Manager answers it."""

    def __init__(self, current: str) -> None:
        self.labels: dict[str, str] = {"AWSCURRENT": current}
        self.reads = 0
        self.failing = False
        self.gate: threading.Event | None = None
        self.entered = threading.Event()
        self.exceptions = SimpleNamespace(ResourceNotFoundException=_NotFound)

    def rotate(self, new: str) -> None:
        """PutSecretValue: the new version AWSCURRENT, the replaced one AWSPREVIOUS."""
        self.labels = {"AWSCURRENT": new, "AWSPREVIOUS": self.labels["AWSCURRENT"]}

    def get_secret_value(self, SecretId: str, VersionStage: str) -> dict[str, Any]:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        self.reads += 1
        if self.failing:
            raise ClientError({"Error": {"Code": "InternalServiceError"}}, "GetSecretValue")
        if VersionStage not in self.labels:
            error = {"Error": {"Code": "ResourceNotFoundException"}}
            raise _NotFound(error, "GetSecretValue")
        return {"SecretString": self.labels[VersionStage]}


def _text() -> str:
    return secrets.token_hex(32)


def test_keys_are_read_once_per_refresh_and_a_rotation_arrives_with_the_next() -> None:
    # GIVEN a secret never rotated, read through SecretKeys every 300 s
    first = _text()
    fake, clock = FakeSecrets(first), Clock(0.0)
    keys = SecretKeys("arn", lambda: fake, refresh_s=300, clock=clock)
    # WHEN the keys are asked for many times within the interval
    rings = [keys.ring() for _ in range(5)]
    # THEN the secret was read once (AWSCURRENT, and AWSPREVIOUS, which does not exist)
    assert fake.reads == 2
    assert rings[-1] == KeyRing(first.encode(), None)
    # WHEN it is rotated: the old key stays in use until the interval passes
    second = _text()
    fake.rotate(second)
    clock.now = 299.0
    assert keys.ring() == KeyRing(first.encode(), None)
    # THEN after it, the new key signs and the old one still verifies
    clock.now = 300.0
    assert keys.ring() == KeyRing(second.encode(), first.encode())
    assert fake.reads == 4


def test_a_failed_read_keeps_the_keys_and_is_retried_soon() -> None:
    key = _text()
    fake, clock = FakeSecrets(key), Clock(0.0)
    keys = SecretKeys("arn", lambda: fake, refresh_s=300, clock=clock)
    assert keys.ring().current == key.encode()
    # GIVEN Secrets Manager fails when the keys fall due
    fake.failing = True
    clock.now = 300.0
    # THEN the keys held are kept, and the next read waits RETRY_S, not a whole interval
    assert keys.ring().current == key.encode()
    reads = fake.reads
    clock.now = 300.0 + RETRY_S - 1
    keys.ring()
    assert fake.reads == reads
    fake.failing = False
    clock.now = 300.0 + RETRY_S
    assert keys.ring().current == key.encode()
    assert fake.reads == reads + 2


def test_a_short_secret_is_no_key() -> None:
    keys = SecretKeys("arn", lambda: FakeSecrets("too-short"), refresh_s=300, clock=Clock(0.0))
    assert keys.ring() == KeyRing(None, None)


def test_an_event_loop_never_waits_for_a_read() -> None:
    # GIVEN a read of the secret that has started and cannot finish yet
    key = _text()
    fake = FakeSecrets(key)
    fake.gate = threading.Event()
    keys = SecretKeys("arn", lambda: fake, refresh_s=300, clock=Clock(0.0))
    backend = ScopeProofs(keys, wall=Clock(), wait=False)
    signed = proofs(KeyRing(key.encode())).sign(ACME)
    # WHEN doors verify meanwhile: THEN each answers at once, unproven (no key held yet)
    assert [backend.verify(signed) for _ in range(3)] == [None] * 3
    assert fake.entered.wait(10)
    # AND once the read finishes (ring() waits for the read in progress), the scope is
    # proven, after one read of each label however many doors asked
    fake.gate.set()
    assert keys.ring().current == key.encode()
    assert backend.verify(signed) == ACME
    assert fake.reads == 2


def test_settings_come_from_scope_proof_variables() -> None:
    settings = ProofSettings.from_env(
        {"SCOPE_PROOF_SECRET_ID": KEY_ARN,
         "SCOPE_PROOF_REFRESH_S": "60", "SCOPE_PROOF_TTL_S": "", "OTHER": "x"}
    )  # fmt: skip
    assert settings.secret_id == KEY_ARN
    assert (settings.refresh_s, settings.ttl_s) == (60.0, 300)
    assert ProofSettings.from_env({}).secret_id is None
