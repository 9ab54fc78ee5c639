"""The live configuration (``spillway.tenancy.directory``): the identity map and the log
level every door reads from one state-table item, within a TTL, without a deploy."""

from __future__ import annotations

import logging

import pytest

from spillway.protocol.errors import InvalidInputError, StateUnavailableError
from spillway.tenancy.directory import (
    CONFIG_KEY,
    CONFIG_MAX_BYTES,
    ConfigWriter,
    LiveConfig,
    LiveConfigCache,
    TenantDirectory,
    apply_log_level,
)
from spillway.tenancy.identity import Authenticator
from tests.memory_store import MemoryStateStore

ARN_A = "arn:aws:iam::123456789012:role/team-a"
ARN_B = "arn:aws:iam::123456789012:role/team-b"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _event(identity: str) -> dict[str, object]:
    return {"requestContext": {"identity": {"userArn": identity}}, "headers": {}}


def _cache(store: MemoryStateStore, clock: Clock, **kwargs: object) -> LiveConfigCache:
    return LiveConfigCache(store, ttl_s=30.0, clock=clock, wall=lambda: 1000.0, **kwargs)  # type: ignore[arg-type]


def test_a_tenant_added_is_seen_after_the_ttl_and_not_before() -> None:
    store, clock = MemoryStateStore(), Clock()
    writer = ConfigWriter(store, wall=lambda: 1000.0)
    writer.add(ARN_A, "acme")
    callers = Authenticator(TenantDirectory(_cache(store, clock)))
    assert callers.tenant(_event(ARN_A)) == "acme"
    assert callers.tenant(_event(ARN_B)) == ARN_B  # unmapped: its own tenant

    writer.add(ARN_B, "globex")
    writer.remove(ARN_A)
    store.calls.clear()
    clock.now = 29.0
    assert callers.tenant(_event(ARN_B)) == ARN_B
    assert callers.tenant(_event(ARN_A)) == "acme"
    clock.now = 30.0
    assert callers.tenant(_event(ARN_B)) == "globex"
    assert callers.tenant(_event(ARN_A)) == ARN_A
    assert store.calls["get"] == 1  # one read a TTL, however many lookups


def test_the_table_overrides_the_functions_own_map() -> None:
    store, clock = MemoryStateStore(), Clock()
    ConfigWriter(store).add(ARN_A, "acme")
    directory = TenantDirectory(_cache(store, clock, base={ARN_A: "old", ARN_B: "beta"}))
    assert dict(directory) == {ARN_A: "acme", ARN_B: "beta"}


def test_no_table_serves_the_static_map_without_reading() -> None:
    directory = TenantDirectory(LiveConfigCache(None, ttl_s=1.0, base={ARN_A: "acme"}))
    assert directory.get(ARN_A) == "acme"
    assert len(directory) == 1


def test_never_read_is_unavailable_not_a_guess_then_the_last_good_is_kept() -> None:
    store, clock = MemoryStateStore(), Clock()
    ConfigWriter(store).add(ARN_A, "acme")
    store.down = True
    store.calls.clear()
    cache = _cache(store, clock, retry_s=1.0)
    with pytest.raises(StateUnavailableError):
        TenantDirectory(cache).get(ARN_A)
    with pytest.raises(StateUnavailableError):  # within retry_s: not asked again
        cache.current()
    assert store.calls["get"] == 1
    clock.now = 1.0
    store.down = False
    assert TenantDirectory(cache).get(ARN_A) == "acme"
    store.down = True
    clock.now = 100.0
    assert TenantDirectory(cache).get(ARN_A) == "acme"  # the last good, while it is down
    assert cache.failures == 2


def test_a_changed_log_level_is_applied_once_per_change() -> None:
    store, clock = MemoryStateStore(), Clock()
    seen: list[str | None] = []
    cache = _cache(store, clock, listeners=[lambda c: seen.append(c.log_level)])
    cache.poll()
    ConfigWriter(store).set_log_level("debug")
    clock.now = 30.0
    cache.poll()
    clock.now = 60.0
    cache.poll()
    assert seen == [None, "DEBUG"]


def test_apply_log_level_sets_the_spillway_logger() -> None:
    root = logging.getLogger("spillway")
    before = root.level
    other = logging.getLogger("spillway-test-other")
    try:
        apply_log_level(LiveConfig({}, "WARNING"), other)
        assert root.level == logging.WARNING
        assert other.level == logging.WARNING
        apply_log_level(LiveConfig({}, None))  # no level named: left as it is
        assert root.level == logging.WARNING
    finally:
        root.setLevel(before)


def test_writes_are_checked_and_refused_clearly() -> None:
    writer = ConfigWriter(MemoryStateStore())
    with pytest.raises(InvalidInputError, match="tenant"):
        writer.add(ARN_A, "not a tenant!")
    with pytest.raises(InvalidInputError, match="identity"):
        writer.add("has space", "acme")
    with pytest.raises(InvalidInputError, match="log level"):
        writer.set_log_level("LOUD")
    with pytest.raises(KeyError):
        writer.remove(ARN_A)


def test_the_configuration_stays_within_a_dynamodb_item() -> None:
    store = MemoryStateStore()
    writer = ConfigWriter(store)
    # Written directly (one write per principal would take a while): near the bound.
    arn = "arn:aws:iam::123456789012:role/" + "r" * 160
    many = {f"{arn}{i:05d}": f"tenant-{i}" for i in range(1900)}
    store.create(CONFIG_KEY, LiveConfig(many).doc(), 0.0, None)
    assert len(writer.read().identities) == 1900
    with pytest.raises(InvalidInputError, match="DynamoDB item"):
        writer.add(f"{arn}-one-more" + "x" * 1800, "acme")
    assert CONFIG_MAX_BYTES < 400 * 1024


def test_concurrent_writers_both_land() -> None:
    store = MemoryStateStore()
    first, second = ConfigWriter(store), ConfigWriter(store)
    real_read = first.read
    raced: list[LiveConfig] = []

    def read_then_race() -> LiveConfig:
        current = real_read()
        if not raced:  # another writer lands between this read and this write
            raced.append(second.add(ARN_B, "globex"))
        return current

    first.read = read_then_race  # type: ignore[method-assign]
    first.add(ARN_A, "acme")
    assert ConfigWriter(store).read().identities == {ARN_A: "acme", ARN_B: "globex"}


def test_the_routers_live_settings_apply_and_a_bad_value_is_refused() -> None:
    from spillway.router.settings import RouterSettings
    from spillway.router.wiring import Overrides, create_app

    store, clock = MemoryStateStore(), Clock()
    live = _cache(store, clock)
    app = create_app(
        RouterSettings(gpu_url=None, default_deadline_ms=5000),
        Overrides(backends={}, state=store, live=live),
    )
    writer = ConfigWriter(store, wall=lambda: 1000.0)
    writer.set_setting("ROUTER_DEFAULT_DEADLINE_MS", "20000")
    writer.set_setting("ROUTER_TRUST_TENANT_HINTS", "true")  # not a live one: ignored
    live.poll()
    assert app.router.config.default_deadline_ms == 20000
    assert app.router.config.trust_tenant_hints is False
    writer.set_setting("ROUTER_DEFAULT_DEADLINE_MS", "-1")
    clock.now = 30.0
    live.poll()
    assert app.router.config.default_deadline_ms == 20000  # the last good kept
    writer.set_setting("ROUTER_DEFAULT_DEADLINE_MS", None)
    clock.now = 60.0
    live.poll()
    assert app.router.config.default_deadline_ms == 5000
