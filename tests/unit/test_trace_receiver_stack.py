"""What ``spillway up`` tells each part about traces: a service name per traced part, the
receiver's endpoint when it runs (not with ``--no-traces``), the sample share passed
through; and the trace view among the stack's URLs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from spillway_cli import up_cli
from spillway_cli.local.layout import TRACED, Ports, StackLayout


def layout(tmp_path: Path, **settings: Any) -> StackLayout:
    return StackLayout(tmp_path / "models", tmp_path / "logs", Ports(traces=4318), **settings)


def test_every_traced_part_exports_to_the_receiver_as_its_own_service(tmp_path: Path) -> None:
    stack = layout(tmp_path)
    for part in ("router", "gpu", "cpu", "jobs", "websocket"):
        assert stack.trace_env(part) == {
            "OTEL_SERVICE_NAME": f"spillway-{part}",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318",
            "OTEL_BSP_SCHEDULE_DELAY": "500",
        }
    assert set(TRACED) == {"router", "gpu", "cpu", "jobs", "websocket"}
    # the receiver, moto and the dashboard trace nothing
    assert (
        stack.trace_env("traces") == stack.trace_env("moto") == stack.trace_env("dashboard") == {}
    )


def test_without_the_receiver_parts_keep_their_names_and_the_sample_share(tmp_path: Path) -> None:
    stack = layout(tmp_path, traces=False, trace_sample=0.25)
    assert stack.trace_env("gpu") == {
        "OTEL_SERVICE_NAME": "spillway-gpu",
        "SPILLWAY_TRACE_SAMPLE": "0.25",
    }
    assert "traces" not in stack.urls()
    assert "SPILLWAY_TRACES_URL" not in stack.stack_env()


def test_the_trace_view_is_among_the_stack_urls_and_in_its_env_file(tmp_path: Path) -> None:
    stack = layout(tmp_path, trace_sample=0.5)
    assert stack.urls()["traces"] == "http://127.0.0.1:4318/traces"
    assert stack.stack_env()["SPILLWAY_TRACES_URL"] == "http://127.0.0.1:4318"
    assert stack.trace_env("router")["SPILLWAY_TRACE_SAMPLE"] == "0.5"


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[dict[str, Any]]:
    """What ``spillway up`` would start the stack with, its checks passed (nothing starts)."""
    calls: list[dict[str, Any]] = []

    def run(*args: Any) -> None:
        names = ("models", "log_dir", "ports", "runtime", "verbose", "fresh", "tracing")
        calls.append(dict(zip(names, args, strict=True)))

    monkeypatch.setattr(up_cli, "_run", run)
    monkeypatch.setattr("spillway_cli.preflight.problems", lambda *args: [])
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SPILLWAY_TRACE_SAMPLE", raising=False)
    return calls


def _up(*args: str, env: dict[str, str] | None = None) -> Any:
    import typer

    app = typer.Typer()
    app.command()(up_cli.up)
    return CliRunner().invoke(app, ["--log-dir", "stack", *args], env=env)


def test_up_runs_the_receiver_unless_told_not_to(started: list[dict[str, Any]]) -> None:
    assert _up("--traces-port", "4999").exit_code == 0
    assert _up("--no-traces").exit_code == 0
    on, off = started
    assert (on["tracing"], on["ports"]["traces"]) == (up_cli.Tracing(True, None), 4999)
    assert off["tracing"] == up_cli.Tracing(False, None)
    assert "traces" not in off["ports"]  # its port is neither checked nor taken


def test_up_takes_the_sample_share_from_its_flag_or_spillway_trace_sample(
    started: list[dict[str, Any]],
) -> None:
    assert _up("--trace-sample", "0.1").exit_code == 0
    assert _up(env={"SPILLWAY_TRACE_SAMPLE": "0.3"}).exit_code == 0
    assert [call["tracing"].sample for call in started] == [0.1, 0.3]
    refused = _up("--trace-sample", "1.5")
    assert refused.exit_code == 2
    assert "--trace-sample" in refused.output
    assert len(started) == 2
