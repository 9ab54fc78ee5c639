"""FairShare's argument checks at their edges and word for word (what the mutation run of
gpu_service/fair_share.py found untested: docs/mutation.md)."""

from __future__ import annotations

import pytest

from gpu_service.fair_share import FairShare


def test_two_tenants_is_the_smallest_memory_allowed() -> None:
    # GIVEN room for exactly two tenants
    share = FairShare(max_tenants=2)
    # WHEN three are charged
    share.charge("a", 1.0, now=0.0)
    share.charge("b", 3.0, now=0.0)
    share.charge("c", 2.0, now=0.0)
    # THEN the most used one is remembered, the others count as unserved
    assert [share.usage(s, 0.0) for s in ("a", "b", "c")] == [0.0, 3.0, 0.0]


@pytest.mark.parametrize("max_tenants", [1, 0, -1])
def test_fewer_than_two_tenants_is_refused_with_its_reason(max_tenants: int) -> None:
    with pytest.raises(ValueError, match="max_tenants") as refused:
        FairShare(max_tenants=max_tenants)
    assert str(refused.value) == "max_tenants must be at least 2"


@pytest.mark.parametrize("half_life_s", [0.0, -1.0])
def test_a_half_life_that_is_not_positive_is_refused_with_its_reason(half_life_s: float) -> None:
    with pytest.raises(ValueError, match="half_life_s") as refused:
        FairShare(half_life_s=half_life_s)
    assert str(refused.value) == "half_life_s must be positive"
