"""The fair-share rule on its own, on an injected clock: usage charged per tenant, halving
every half-life, and the order it gives tenants (what the batcher takes next)."""

from __future__ import annotations

import pytest

from gpu_service.batching_policy import batching_policy
from gpu_service.fair_share import FairShare
from gpu_service.settings import GpuSettings
from spillway.state.table import scope
from tests.fakes import tensor_config

ACME, GLOBEX = scope("acme"), scope("globex")


def test_usage_halves_every_half_life() -> None:
    # GIVEN acme charged 8 rows at t=0 with a half-life of 2 s
    share = FairShare(half_life_s=2.0)
    share.charge(ACME, 8, now=0.0)
    # THEN it counts 8 then, 4 after 2 s, 1 after 6 s; a tenant never charged counts 0
    assert share.usage(ACME, 0.0) == 8.0
    assert share.usage(ACME, 2.0) == pytest.approx(4.0)
    assert share.usage(ACME, 6.0) == pytest.approx(1.0)
    assert share.usage(GLOBEX, 6.0) == 0.0


def test_charges_add_up_on_the_decayed_usage() -> None:
    share = FairShare(half_life_s=1.0)
    share.charge(ACME, 4, now=0.0)
    share.charge(ACME, 4, now=1.0)  # 2 left of the first 4
    assert share.usage(ACME, 1.0) == pytest.approx(6.0)
    assert share.usage(ACME, 2.0) == pytest.approx(3.0)


def test_rank_adds_what_the_batch_being_formed_already_gives() -> None:
    # GIVEN acme served 2 rows lately and globex none
    share = FairShare()
    share.charge(ACME, 2, now=0.0)
    # THEN globex goes first, until the batch being formed gives it 3 rows
    assert share.rank(GLOBEX, 0.0, {}) < share.rank(ACME, 0.0, {})
    assert share.rank(GLOBEX, 0.0, {GLOBEX: 3}) > share.rank(ACME, 0.0, {})
    # AND requests no scope was proven for are one tenant of their own
    share.charge(None, 5, now=0.0)
    assert share.rank(None, 0.0, {}) == 5.0


def test_past_max_tenants_the_least_used_half_is_forgotten() -> None:
    # GIVEN room for 4 tenants, and 5 charged 1..5 rows
    share = FairShare(max_tenants=4)
    for rows in range(1, 6):
        share.charge(scope(f"t{rows}"), rows, now=0.0)
    # THEN the two most used are remembered; the others count as unserved
    assert [share.usage(scope(f"t{rows}"), 0.0) for rows in range(1, 6)] == [0, 0, 0, 4, 5]


def test_a_half_life_must_be_positive() -> None:
    with pytest.raises(ValueError, match="half_life_s must be positive"):
        FairShare(half_life_s=0)


@pytest.mark.parametrize("on", [True, False])
def test_the_service_settings_reach_every_batcher_policy(on: bool) -> None:
    # GIVEN the service's fair-share settings
    settings = GpuSettings(fair_share=on, fair_share_half_life_s=2.5)
    # THEN a model's batching policy, with or without dynamic batching, carries them
    for config in (
        tensor_config("m"),
        tensor_config("m").model_copy(update={"dynamic_batching": None}),
    ):
        policy = batching_policy(config, settings)
        assert (policy.fair_share, policy.fair_share_half_life_s) == (on, 2.5)
