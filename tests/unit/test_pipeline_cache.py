"""The step cache: keys that change with anything that changes the result, a bounded
memory tier, and a tiered look-up that keeps shared hits in memory."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from spillway.models.processing import Tensors
from spillway.pipelines.stepcache import (
    SHARED_SCOPE,
    CacheSettings,
    MemoryCache,
    TieredCache,
    cache_key,
    decode_entry,
    encode_entry,
    open_cache,
    tensors_size,
)
from spillway.state.table import scope

CONFIGURATION = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
TEXT = {"text": np.array([[b"hello"]], dtype=np.object_)}
VECTOR = {"v": np.arange(4, dtype=np.float32).reshape(1, 4)}


def key(inputs: Tensors, version: int = 1, digest: str = "d", owner: str = "-") -> str:
    return cache_key(owner, "minilm", version, digest, inputs)


def test_a_key_changes_with_tenant_version_configuration_and_every_input_detail() -> None:
    base = key(TEXT)
    assert base.startswith("-/minilm/1/")
    assert key(TEXT) == base  # the same request, the same key
    changed = [
        key(TEXT, owner=scope("tenant-a")),
        key(TEXT, owner=scope("tenant-b")),
        key(TEXT, owner=SHARED_SCOPE),
        key(TEXT, version=2),
        key(TEXT, digest="other"),
        key({"text": np.array([[b"hellO"]], dtype=np.object_)}),
        key({"other": TEXT["text"]}),
        key(VECTOR),
        key({"v": VECTOR["v"].astype(np.float64)}),
        key({"v": VECTOR["v"].reshape(2, 2)}),
    ]
    assert len({base, *changed}) == len(changed) + 1


def test_the_memory_tier_drops_the_least_recently_used_past_its_bound() -> None:
    # GIVEN a cache of three 16-byte entries' room
    entry = tensors_size(VECTOR)
    cache = MemoryCache(3 * entry)
    cache.put_many([(f"k{i}", VECTOR) for i in range(3)])
    # WHEN k0 is read (most recent now) and a fourth entry comes
    assert cache.get_many(["k0"])[0] is not None
    cache.put_many([("k3", VECTOR)])
    # THEN k1, the least recently used, is gone and the bytes stay within the bound
    assert [e is not None for e in cache.get_many(["k0", "k1", "k2", "k3"])] == [
        True,
        False,
        True,
        True,
    ]
    assert cache.bytes == 3 * entry
    assert len(cache) == 3


def test_a_stored_entry_is_a_frozen_copy() -> None:
    cache = MemoryCache(1 << 10)
    batch = np.zeros((4, 4), dtype=np.float32)
    cache.put_many([("k", {"v": batch[:1]})])  # a view into a bigger batch
    batch[0, 0] = 9.0
    (stored,) = cache.get_many(["k"])
    assert stored is not None
    assert stored["v"][0, 0] == 0.0
    assert not stored["v"].flags.writeable
    cache.put_many([("big", {"v": np.zeros(1024, dtype=np.float32)})])  # over the bound
    assert cache.get_many(["big"]) == [None]


def test_entries_round_trip_in_the_wire_layout() -> None:
    tensors = {**TEXT, **VECTOR}
    body, length = encode_entry(tensors)
    back = decode_entry(body, length)
    assert back["text"].tolist() == [[b"hello"]]
    np.testing.assert_array_equal(back["v"], VECTOR["v"])


class FakeShared:
    """A shared tier in a dict, counting look-ups."""

    blocking = True

    def __init__(self) -> None:
        self.entries: dict[str, Tensors] = {}
        self.gets = 0

    def get_many(self, keys: Sequence[str]) -> list[Tensors | None]:
        self.gets += len(keys)
        return [self.entries.get(k) for k in keys]

    def put_many(self, entries: Sequence[tuple[str, Tensors]]) -> None:
        self.entries.update(entries)


def test_a_shared_hit_is_kept_in_memory() -> None:
    # GIVEN an entry only the shared tier holds (another replica computed it)
    shared = FakeShared()
    shared.entries["k"] = VECTOR
    cache = TieredCache(MemoryCache(1 << 10), shared)
    assert cache.blocking
    # WHEN it is read twice
    first, second = cache.get_many(["k"])[0], cache.get_many(["k"])[0]
    # THEN the second read never reached the shared tier
    assert first is not None
    assert second is not None
    assert shared.gets == 1
    cache.put_many([("new", VECTOR)])
    assert "new" in shared.entries


def test_settings_come_from_the_environment_and_the_readme_documents_them() -> None:
    settings = CacheSettings.from_env({"PIPELINE_CACHE_MB": "0", "PIPELINE_CACHE_TABLE": ""})
    assert (settings.mb, settings.table) == (0.0, None)
    assert open_cache(settings) is None
    memory_only = open_cache(CacheSettings())
    assert memory_only is not None
    assert not memory_only.blocking
    with pytest.raises(ValueError, match="ttl_s"):
        CacheSettings.from_env({"PIPELINE_CACHE_TTL_S": "1"})
    text = CONFIGURATION.read_text()
    assert [
        n for n in CacheSettings.model_fields if f"`PIPELINE_CACHE_{n.upper()}`" not in text
    ] == []


@pytest.mark.parametrize("owner", ["", "tenant-a", "-/..", "SHARED", "0" * 31, "g" * 32])
def test_a_key_names_a_scope_or_nothing(owner: str) -> None:
    # A key segment that is no scope would let a name reach into another caller's keys.
    with pytest.raises(ValueError, match="not a tenant scope"):
        key(TEXT, owner=owner)
