"""``spillway policy check`` and ``spillway policy explain``."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from typer.testing import CliRunner

from spillway_cli.router_cli import policy_app

EXAMPLE = Path(__file__).resolve().parents[2] / "policies" / "example.yaml"
CLI = typer.Typer()
CLI.add_typer(policy_app, name="policy")  # as spillway_cli.main registers it
INFER = {"inputs": [{"name": "image", "shape": [1, 8, 8], "datatype": "FP32", "data": [0] * 64}]}


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(CLI, ["policy", *args])
    return result.exit_code, result.output


def test_check_accepts_the_example_policy() -> None:
    code, output = run("check", str(EXAMPLE))
    assert code == 0
    assert "valid, 9 rules: batch-requested, nightly-rescoring" in output


def test_check_refuses_a_bad_policy_with_its_reason(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  - {name: a, route: tpu}\n")
    code, output = run("check", str(bad))
    assert code == 1
    assert "rules.0.route: Input should be 'gpu', 'cpu' or 'batch'" in output


def test_check_reports_a_missing_file(tmp_path: Path) -> None:
    code, output = run("check", str(tmp_path / "none.yaml"))
    assert code == 1
    assert "No such file" in output


def test_explain_names_the_rule_and_why_the_others_did_not_fire() -> None:
    request = {**INFER, "parameters": {"priority": 3}}
    code, output = run(
        "explain",
        str(EXAMPLE),
        "--request",
        json.dumps(request),
        "--gpu-busy",
        "0.9",
        "--busy-for",
        "301",
    )
    assert code == 0, output
    lines = output.splitlines()
    assert lines[0] == "skip  batch-requested: mode auto is not one of ['batch']"
    assert "FIRES hot-gpu-spill-low-priority: all conditions hold" in lines
    assert "decision: rule hot-gpu-spill-low-priority, backends gpu -> cpu" in lines
    assert "spill: 10% of these requests go cpu -> gpu" in lines


def test_explain_takes_an_envelope_with_headers_and_a_time() -> None:
    request = {"headers": {"X-Spillway-Tenant": "trust-safety"}, "body": INFER}
    night = "2026-01-15T01:30:00+01:00"
    code, output = run("explain", str(EXAMPLE), "--request", json.dumps(request), "--at", night)
    assert code == 0, output
    assert "decision: rule nightly-rescoring, backends batch" in output
    code, output = run("explain", str(EXAMPLE), "--request", json.dumps(request))
    assert code == 0


def test_explain_refuses_a_bad_request_clearly() -> None:
    code, output = run("explain", str(EXAMPLE), "--request", "{not json")
    assert code == 1
    assert "--request is not JSON" in output
    bad_hint = {"headers": {"x-spillway-mode": "turbo"}, "body": INFER}
    code, output = run("explain", str(EXAMPLE), "--request", json.dumps(bad_hint))
    assert code == 1
    assert "cannot explain: mode must be one of" in output
