"""The policy tuner on the worked example of docs/tuning.md, and its promises.

GIVEN a recorded day of ranking traffic (tests/unit/tune_trace.py: quiet at night, 0.5
rps by day, 3.2 rps at noon against one GPU task's 2 rows/s) under a policy that spills
every low-priority request once the GPU is half busy, WHEN the tuner replays it, THEN it
recovers who sent what, reproduces the recording, and proposes what the hand analysis
finds: spill 65% instead of 100% (cheaper, and the interactive SLO kept, which the
recorded policy broke). It never proposes a policy whose replay breaks an SLO.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from spillway.policy.rules import parse_policy
from spillway.router.settings import RouterSettings
from spillway_cli.main import app
from spillway_cli.plan import inputs
from spillway_cli.tune.search import Setting, Slo, propose, with_setting
from spillway_cli.tune.session import Tuned, TuneError, run_tune
from spillway_cli.tune.simulate import Binned, binned, replay
from spillway_cli.tune.trace import Recorded, group_requests, read_trace
from tests.unit.tune_trace import (
    BIN_S,
    EXAMPLES,
    example_backends,
    example_policy,
    true_groups,
    write_trace,
)

SLO_FILE = EXAMPLES / "tune-slo.yaml"


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tune") / "trace.jsonl"
    write_trace(path)
    return path


@pytest.fixture(scope="module")
def recorded(trace_file: Path) -> tuple[list[Recorded], Binned]:
    """The trace as read, and as replayed: groups per bin."""
    trace = read_trace([trace_file])
    return trace, binned(group_requests(example_policy(), trace, BIN_S), 2)


@pytest.fixture(scope="module")
def tuned(trace_file: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Tuned, Path]:
    out = tmp_path_factory.mktemp("tuned") / "policy.yaml"
    result = run_tune(
        [trace_file],
        EXAMPLES / "tune-policy.yaml",
        SLO_FILE,
        out,
        measured=EXAMPLES / "tune-measured.yaml",
    )
    return result, out


def test_the_kinds_of_request_are_recovered_from_the_recorded_rules(
    recorded: tuple[list[Recorded], Binned],
) -> None:
    truth: Counter[str] = Counter()
    for group in true_groups(example_policy()):
        truth[group.kind] += group.count
    found: Counter[str] = Counter()
    for _, groups in recorded[1]:
        for group in groups:
            found[group.kind] += group.count
    assert found == truth == Counter({"interactive": 6725, "spill-when-hot": 26899})


def test_replaying_the_recorded_policy_reproduces_the_recording(
    recorded: tuple[list[Recorded], Binned],
) -> None:
    trace, bins = recorded
    outcome = replay(example_policy(), bins, example_backends(), BIN_S)
    assert outcome.routes == Counter((r.rule, r.backend) for r in trace)


def test_the_tuner_proposes_what_the_hand_analysis_finds(tuned: tuple[Tuned, Path]) -> None:
    result, out = tuned
    proposal = result.proposal
    assert proposal.recorded.breaches == ("interactive",)  # the spill switches itself off
    assert proposal.best is not None
    assert proposal.changes == ["spill-when-hot: spill.share 1 -> 0.65"]
    assert proposal.best.breaches == ()
    recorded, best = proposal.recorded.outcome, proposal.best.outcome
    assert best.cost_usd < recorded.cost_usd * 0.91  # 9.7% less
    assert best.kinds["interactive"].p99_ms <= 100
    assert best.kinds["spill-when-hot"].p99_ms <= 300
    assert parse_policy(out.read_text()) == proposal.best.policy
    assert "spill-when-hot: spill.share 1 -> 0.65" in result.report


def test_the_replay_reads_load_as_the_deployment_does(
    recorded: tuple[list[Recorded], Binned],
) -> None:
    # GIVEN a router that averages the GPU's load over ten minutes instead of ten seconds
    trace, bins = recorded
    slow = replace(example_backends(), router=RouterSettings(load_halflife_s=600.0))
    # WHEN the recorded policy is replayed with those settings
    outcome = replay(example_policy(), bins, slow, BIN_S)
    # THEN its load condition holds at other times: the routes are not the recorded ones
    assert outcome.routes != Counter((r.rule, r.backend) for r in trace)
    assert outcome.routes.total() == len(trace)


def test_the_tuner_takes_the_load_settings_from_the_router_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN a deployment whose ROUTER_* environment sets the load tracker's figures
    monkeypatch.setenv("ROUTER_LOAD_HALFLIFE_S", "600")
    monkeypatch.setenv("ROUTER_LOAD_STALE_S", "900")
    short = tmp_path / "trace.jsonl"
    write_trace(short, segments=((11.0, 11.1, 3.2),))
    lax = tmp_path / "slo.yaml"
    lax.write_text("routes: {interactive: 100000, spill-when-hot: 100000}\n")
    # WHEN the tuner runs
    result = run_tune(
        [short],
        EXAMPLES / "tune-policy.yaml",
        lax,
        tmp_path / "policy.yaml",
        measured=EXAMPLES / "tune-measured.yaml",
    )
    # THEN its replay read load with them, and the report says so
    assert "half-life 600 s, a reading stale after 900 s" in result.report


def test_a_smaller_share_breaks_the_interactive_slo(
    recorded: tuple[list[Recorded], Binned],
) -> None:
    """The hand analysis' lower bound: below about 65% the noon GPU is too slow."""
    slo: Slo = inputs.load_model(Slo, SLO_FILE)
    smaller = with_setting(example_policy(), "spill-when-hot", Setting(0.6, 0.5, 0.0), "cpu")
    assert slo.breaches(replay(smaller, recorded[1], example_backends(), BIN_S)) == ["interactive"]


@settings(
    max_examples=5,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    quiet=st.floats(0.05, 1.0),
    busy=st.floats(1.0, 5.0),
    interactive_slo=st.sampled_from([60.0, 90.0, 150.0, 500.0]),
    low_slo=st.sampled_from([100.0, 200.0, 1000.0]),
)
def test_no_proposal_breaks_an_slo(
    quiet: float, busy: float, interactive_slo: float, low_slo: float
) -> None:
    """Whatever the traffic and the objectives, a proposal's own replay keeps them all."""
    policy, backends = example_policy(), example_backends()
    segments = ((0.0, 0.1, quiet), (0.1, 0.3, busy), (0.3, 0.4, quiet))
    bins = binned(true_groups(policy, segments), policy.defaults.priority)
    slo = Slo(routes={"interactive": interactive_slo, "spill-when-hot": low_slo})
    proposal = propose(policy, lambda p: replay(p, bins, backends, BIN_S), slo)
    if proposal.best is None:
        return
    assert proposal.best.breaches == ()
    assert slo.breaches(replay(proposal.best.policy, bins, backends, BIN_S)) == []
    if not proposal.recorded.breaches:
        assert proposal.best.outcome.cost_usd <= proposal.recorded.outcome.cost_usd


def test_nothing_is_written_when_no_policy_keeps_the_slos(tmp_path: Path) -> None:
    short = tmp_path / "trace.jsonl"
    write_trace(short, segments=((11.0, 11.1, 3.2),))
    impossible = tmp_path / "slo.yaml"
    impossible.write_text("routes: {interactive: 10}\n")  # under the GPU's lightest p50
    out = tmp_path / "policy.yaml"
    with pytest.raises(TuneError, match="no candidate keeps every SLO"):
        run_tune(
            [short],
            EXAMPLES / "tune-policy.yaml",
            impossible,
            out,
            measured=EXAMPLES / "tune-measured.yaml",
        )
    assert not out.exists()


def test_policy_apply_replaces_the_file_only_with_a_valid_policy(tmp_path: Path) -> None:
    target = tmp_path / "policy.yaml"
    target.write_text("old")
    runner = CliRunner()
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules: []\n")
    result = runner.invoke(app, ["policy", "apply", str(bad), "--file", str(target)])
    assert result.exit_code == 1
    assert target.read_text() == "old"
    good = EXAMPLES / "tune-policy.yaml"
    result = runner.invoke(app, ["policy", "apply", str(good), "--file", str(target)])
    assert result.exit_code == 0, result.output
    assert target.read_text() == good.read_text()
    both = runner.invoke(app, ["policy", "apply", str(good)])
    assert both.exit_code == 1


def _noon_args(tmp_path: Path, slo_text: str) -> tuple[list[Path], Path, Path, Path]:
    """The tuner's metrics (a few minutes of the noon peak), policy, SLO file (holding
    ``slo_text``) and output path."""
    short = tmp_path / "trace.jsonl"
    write_trace(short, segments=((11.0, 11.1, 3.2),))
    slo = tmp_path / "slo.yaml"
    slo.write_text(slo_text)
    return [short], EXAMPLES / "tune-policy.yaml", slo, tmp_path / "policy.yaml"


def test_an_slo_that_names_no_route_seen_is_warned_about(tmp_path: Path) -> None:
    # GIVEN traffic of two routes and an SLO file that also names a third (a typo)
    slo = "routes: {interactive: 100000, spill-when-hot: 100000, interactve: 50}\n"
    # WHEN the tuner runs
    result = run_tune(*_noon_args(tmp_path, slo), measured=EXAMPLES / "tune-measured.yaml")
    # THEN the report warns about that name alone, naming the routes seen
    warnings = [line for line in result.report.splitlines() if line.startswith("Warning")]
    assert warnings == [
        "Warning: the SLO file names route 'interactve', which no request took "
        "(routes seen: interactive, spill-when-hot)."
    ]
    # AND the routes it does name still get a verdict
    assert result.proposal.best is not None


def test_no_policy_is_called_cheapest_without_an_slo_to_hold(tmp_path: Path) -> None:
    # GIVEN traffic and an SLO file none of whose names is a route of it
    metrics, policy, slo, out = _noon_args(tmp_path, "routes: {ranking: 100, batch: 300}\n")
    measured = EXAMPLES / "tune-measured.yaml"
    # WHEN the tuner runs, as a function and as the command
    with pytest.raises(TuneError, match="nothing to hold") as refused:
        run_tune(metrics, policy, slo, out, measured=measured)
    args = ["tune", "--metrics", str(metrics[0]), "--policy", str(policy), "--slo", str(slo)]
    result = CliRunner().invoke(app, [*args, "--out", str(out), "--measured", str(measured)])
    # THEN it warns about each name, gives no verdict, writes nothing and exits non-zero
    report = refused.value.report
    seen = "(routes seen: interactive, spill-when-hot)"
    for name in ("batch", "ranking"):
        assert (
            f"Warning: the SLO file names route {name!r}, which no request took {seen}." in report
        )
    assert "cheapest" not in report
    assert "Proposed change" not in report
    assert result.exit_code == 1
    assert "Warning: the SLO file names route 'ranking'" in result.output
    assert "nothing to hold" in result.output
    assert "already the cheapest" not in result.output
    assert not out.exists()
