"""``spillway dashboard`` and ``spillway cost report`` find a running ``spillway up`` stack
through its stack env file when no flag or variable names their sources, as the other
commands do: the router's logs, the services' URLs, the tables and the policy; flags and
variables already set win."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from spillway.policy.accounting import EmfSink, RouteRecord
from spillway_cli.dashboard.command import Sources, with_stack_defaults
from spillway_cli.local import stackenv
from spillway_cli.local.layout import Ports
from spillway_cli.local.names import POLICY_PARAMETER, STATE_TABLE
from spillway_cli.local.stack import LocalStack
from spillway_cli.main import app

runner = CliRunner()


def _stack_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runtime: str = "wsgi"
) -> LocalStack:
    """A stack on fixed ports (not started) whose env file names this process, found
    through ``SPILLWAY_STACK_ENV``; none of its variables set beforehand (each restored
    as it was after the test)."""
    local = LocalStack(
        tmp_path / "models",
        tmp_path / "logs",
        Ports(5000, 8000, 8081, 8082, 8080),
        router_runtime=runtime,
    )
    values = local.stack_env()
    for name in values:
        monkeypatch.setenv(name, "")  # recorded, so the teardown restores what was there
        monkeypatch.delenv(name)
    monkeypatch.setenv(stackenv.PATH_VARIABLE, str(tmp_path / "env.json"))
    stackenv.write_stack_env(tmp_path / "env.json", values)
    return local


@pytest.mark.parametrize(
    ("runtime", "logs"),
    [
        ("wsgi", ["router-metrics.jsonl", "router.log"]),
        ("serverless-offline", ["router.log"]),
    ],
)
def test_the_dashboard_reads_the_running_stack_when_no_flag_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runtime: str, logs: list[str]
) -> None:
    # GIVEN a running stack's env file, and no flag
    _stack_file(tmp_path, monkeypatch, runtime)
    # WHEN the dashboard takes its sources
    found = with_stack_defaults(Sources(logs=[]))
    # THEN they are the stack's: the router's metrics log and log (one file under
    # serverless-offline), the services, the tables and where the router reads its policy
    assert found.logs == [tmp_path / "logs" / name for name in logs]
    assert (found.gpu_url, found.cpu_url) == ("http://127.0.0.1:8000", "http://127.0.0.1:8081")
    assert (found.state_table, found.jobs_table) == (STATE_TABLE, "spillway-jobs")
    if runtime == "wsgi":
        assert found.policy_file == tmp_path / "logs" / "policy.yaml"
        assert found.policy_parameter is None
    else:
        assert found.policy_file is None
        assert found.policy_parameter == POLICY_PARAMETER


def test_the_dashboards_flags_and_set_variables_win_over_the_stack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN a running stack's env file and a state table set in the environment
    _stack_file(tmp_path, monkeypatch)
    monkeypatch.setenv("ROUTER_STATE_TABLE", "set-table")
    # WHEN the dashboard is given a log, a GPU URL and a policy parameter
    given = Sources(
        logs=[tmp_path / "mine.log"],
        gpu_url="http://127.0.0.1:9000",
        policy_parameter="/mine",
    )
    found = with_stack_defaults(given)
    # THEN those are kept, the variable is taken, and only the rest is the stack's
    assert found.logs == [tmp_path / "mine.log"]
    assert (found.gpu_url, found.cpu_url) == ("http://127.0.0.1:9000", "http://127.0.0.1:8081")
    assert (found.policy_file, found.policy_parameter) == (None, "/mine")
    assert found.state_table == "set-table"


def test_without_a_stack_or_a_log_the_dashboard_says_what_to_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN no stack env file and no router log variables
    monkeypatch.setenv(stackenv.PATH_VARIABLE, str(tmp_path / "none.json"))
    for name in ("SPILLWAY_METRICS_LOG", "SPILLWAY_ROUTER_LOG"):
        monkeypatch.delenv(name, raising=False)
    # WHEN the dashboard starts without --log
    result = runner.invoke(app, ["dashboard", "--no-async-backlog"])
    # THEN it refuses in one line
    assert result.exit_code == 1
    assert result.output.strip() == (
        "no router log: pass --log (or start a local stack with `spillway up`)"
    )


def _metrics(path: Path) -> None:
    stream = io.StringIO()
    sink = EmfSink(stream=stream)
    sink.emit(RouteRecord("default", "gpu", "digits", 200, 10.0, 1e-6))
    sink.emit(RouteRecord("default", "gpu", "digits", 200, 30.0, 3e-6))
    sink.emit(RouteRecord("spill", "cpu", "digits", 504, 90.0, 4e-5, spilled=True))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(stream.getvalue())


def test_cost_report_reads_the_running_stacks_metrics_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN a running stack whose router wrote three requests to its metrics log
    local = _stack_file(tmp_path, monkeypatch)
    _metrics(local.metrics_log)
    # WHEN the cost report is asked for without a LOG
    result = runner.invoke(app, ["cost", "report", "--format", "json"])
    # THEN it summarises that file
    assert local.metrics_log == tmp_path / "logs" / "router-metrics.jsonl"
    assert result.exit_code == 0, result.output
    rows = {(r["rule"], r["backend"]): r["requests"] for r in json.loads(result.output)}
    assert rows == {("default", "gpu"): 2, ("spill", "cpu"): 1}


def test_cost_report_takes_a_set_variable_over_the_stack_and_says_when_there_is_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN a running stack, and SPILLWAY_METRICS_LOG naming another file
    _stack_file(tmp_path, monkeypatch)
    other = tmp_path / "other.jsonl"
    _metrics(other)
    monkeypatch.setenv("SPILLWAY_METRICS_LOG", str(other))
    # WHEN the cost report is asked for without a LOG
    taken = runner.invoke(app, ["cost", "report", "--format", "json"])
    # THEN it reads the variable's file
    assert taken.exit_code == 0, taken.output
    assert sum(r["requests"] for r in json.loads(taken.output)) == 3
    # AND without a stack or the variable it says what to give, in one line
    monkeypatch.delenv("SPILLWAY_METRICS_LOG")
    monkeypatch.setenv(stackenv.PATH_VARIABLE, str(tmp_path / "none.json"))
    refused = runner.invoke(app, ["cost", "report"])
    assert refused.exit_code == 1
    assert refused.output.strip() == (
        "no metrics log: give LOG (or start a local stack with `spillway up`)"
    )


def test_the_websocket_door_is_in_the_stack_env_and_answers_through_its_own_port(
    tmp_path: Path,
) -> None:
    # GIVEN a stack whose WebSocket API is on port 8093
    local = LocalStack(tmp_path / "models", tmp_path / "logs", Ports(websocket=8093))
    # THEN clients find it in the stack env, and the WebSocket function pushes its answers
    # to that port's @connections API with the router's own settings, a connection's
    # tenant named on $connect (nothing authenticates a local caller)
    assert local.stack_env()["SPILLWAY_WEBSOCKET_URL"] == "ws://127.0.0.1:8093"
    env = local.websocket_env()
    assert env["WS_MANAGEMENT_ENDPOINT"] == "http://127.0.0.1:8093"
    assert env["ROUTER_TRUST_TENANT_HINTS"] == "true"
    assert {k: v for k, v in env.items() if k in local.router_env()} == local.router_env()
