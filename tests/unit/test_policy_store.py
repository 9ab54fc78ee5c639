"""The policy store: TTL refresh from a file, bad new policies refused, last good kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from spillway.policy.rules import PolicyError
from spillway.policy.store import FileSource, PolicyStore
from tests.unit.test_router import Clock

GOOD = "rules:\n  - {name: first, route: gpu}\n"
OTHER = "rules:\n  - {name: second, route: cpu}\n"
BAD = "rules:\n  - {name: broken, route: tpu}\n"


def store(path: Path, clock: Clock, rejected: list[str] | None = None) -> PolicyStore:
    return PolicyStore(
        FileSource(path),
        ttl_s=60,
        clock=clock,
        on_reject=None if rejected is None else rejected.append,
    )


def test_a_new_policy_is_used_after_the_ttl(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    clock = Clock()
    policies = store(path, clock)
    assert policies.policy.rules[0].name == "first"
    path.write_text(OTHER)
    clock.now += 59
    assert policies.policy.rules[0].name == "first"
    clock.now += 1
    assert policies.policy.rules[0].name == "second"
    assert policies.loaded.source == str(path)


def test_a_bad_new_policy_is_refused_and_the_last_good_one_keeps_serving(tmp_path: Path) -> None:
    # GIVEN a store serving a good policy
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    clock, rejected = Clock(), list[str]()
    policies = store(path, clock, rejected)
    # WHEN the file is replaced by a policy that does not validate
    path.write_text(BAD)
    clock.now += 60
    # THEN the good one still serves, and the refusal is counted with its reason
    assert policies.policy.rules[0].name == "first"
    assert policies.rejections == 1
    assert len(rejected) == 1
    assert "rules.0.route" in rejected[0]
    # WHEN the file disappears, the same holds
    path.unlink()
    clock.now += 60
    assert policies.policy.rules[0].name == "first"
    assert policies.rejections == 2
    # WHEN a good policy comes back, it is used
    path.write_text(OTHER)
    clock.now += 60
    assert policies.policy.rules[0].name == "second"
    assert policies.last_error is None


def test_a_bad_file_at_start_up_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(BAD)
    with pytest.raises(PolicyError, match=r"rules\.0\.route"):
        store(path, Clock())


def test_without_a_source_the_built_in_policy_serves() -> None:
    policies = PolicyStore(None, ttl_s=0, clock=Clock())
    assert policies.loaded.source == "built-in"
    assert [r.name for r in policies.policy.rules][-1] == "default"
