"""Cost estimates per route, their EMF metrics, and ``spillway cost report``."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from spillway.policy.accounting import (
    CapacityPrice,
    EmfSink,
    LambdaPrice,
    Pricing,
    RouteRecord,
    event_metric,
    load_pricing,
    route_metrics,
)
from spillway_cli.cost_report import as_json, markdown, summarise
from spillway_cli.router_cli import cost_app

CLI = typer.Typer()
CLI.add_typer(cost_app, name="cost")  # as spillway_cli.main registers it
PRICING = Path(__file__).resolve().parents[2] / "config" / "pricing.yaml"


def test_lambda_cost_rounds_duration_up_to_the_millisecond() -> None:
    # GIVEN a 1 GB function at $0.0000166667 per GB-s and $0.20 per million requests
    price = LambdaPrice(usd_per_gb_second=0.0000166667, usd_per_request=0.0000002, memory_mb=1024)
    # WHEN it runs 100.2 ms (billed as 101 ms)
    cost = price.cost(0.1002)
    # THEN the bill is 0.101 GB-s plus the request
    assert cost == pytest.approx(0.101 * 0.0000166667 + 0.0000002, rel=1e-12)


def test_capacity_cost_spreads_the_hour_over_measured_throughput() -> None:
    price = CapacityPrice(usd_per_hour=3.6, inferences_per_second=100)
    assert price.cost(rows=1) == pytest.approx(1e-5)
    assert price.cost(rows=32) == pytest.approx(32e-5)


def test_each_backend_is_billed_its_own_way() -> None:
    pricing = Pricing(
        cpu=LambdaPrice(usd_per_gb_second=1.0, usd_per_request=0.0, memory_mb=2048),
        gpu=CapacityPrice(usd_per_hour=3600, inferences_per_second=10),
        batch=CapacityPrice(usd_per_hour=3600, inferences_per_second=1000),
    )
    assert pricing.attempt("cpu", rows=4, billed_s=0.5, served=False) == pytest.approx(1.0)
    assert pricing.attempt("gpu", rows=4, billed_s=0.5, served=True) == pytest.approx(0.4)
    assert pricing.attempt("gpu", rows=4, billed_s=0.5, served=False) == 0.0
    assert pricing.attempt("batch", rows=4, billed_s=9.0, served=True) == pytest.approx(0.004)


def test_the_pricing_file_in_the_repository_loads() -> None:
    pricing = load_pricing(PRICING)
    assert pricing.cpu.memory_mb == 3008
    assert pricing.gpu.usd_per_hour > 0
    assert load_pricing(None) == Pricing()


def test_a_bad_pricing_file_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "pricing.yaml"
    bad.write_text("gpu: {usd_per_hour: -1, inferences_per_second: 10}\n")
    with pytest.raises(ValueError, match="invalid pricing"):
        load_pricing(bad)


def test_route_metrics_are_emf_in_the_spillway_namespace() -> None:
    record = RouteRecord("default", "cpu", "digits", 200, 12.5, 3e-6, fallback=True, attempts=2)
    document = route_metrics(record)
    directive = document["_aws"]["CloudWatchMetrics"][0]  # type: ignore[index]
    assert directive["Namespace"] == "Spillway"
    assert directive["Dimensions"] == [["rule", "backend", "model", "service"]]
    names = {m["Name"] for m in directive["Metrics"]}
    assert names == {"Requests", "CostUSD", "LatencyMs", "Fallbacks", "Spills", "Errors"}
    assert (document["rule"], document["backend"], document["model"]) == (
        "default",
        "cpu",
        "digits",
    )
    assert document["CostUSD"] == [3e-6]
    assert document["Fallbacks"] == [1.0]
    assert document["status"] == 200


def _log(records: list[RouteRecord]) -> str:
    stream = io.StringIO()
    sink = EmfSink(stream=stream)
    stream.write("START RequestId: 1 Version: $LATEST\n")  # CloudWatch noise is skipped
    for record in records:
        sink.emit(record)
        stream.write('{"level":"INFO","message":"routed"}\n')
    sink.write(event_metric("PolicyRejected"))
    return stream.getvalue()


RECORDS = [
    RouteRecord("default", "gpu", "digits", 200, 10.0, 1e-6),
    RouteRecord("default", "gpu", "digits", 200, 30.0, 3e-6),
    RouteRecord("default", "cpu", "digits", 200, 80.0, 2e-5, fallback=True),
    RouteRecord("spill", "cpu", "digits", 504, 90.0, 4e-5, spilled=True),
]


def test_report_summarises_by_route() -> None:
    routes = summarise(_log(RECORDS).splitlines())
    summary = {(r.rule, r.backend): r for r in routes}
    assert set(summary) == {("default", "gpu"), ("default", "cpu"), ("spill", "cpu")}
    gpu = summary["default", "gpu"]
    assert (gpu.requests, gpu.errors, gpu.fallbacks) == (2, 0, 0)
    assert gpu.cost_usd == pytest.approx(4e-6)
    assert gpu.usd_per_1k == pytest.approx(2e-3)
    assert gpu.latency_ms(0.5) == 10.0
    assert gpu.latency_ms(0.99) == 30.0
    assert summary["default", "cpu"].fallbacks == 1
    assert (summary["spill", "cpu"].spills, summary["spill", "cpu"].errors) == (1, 1)
    # most expensive route first
    assert (routes[0].rule, routes[0].backend) == ("spill", "cpu")


def test_report_renders_markdown_with_a_total() -> None:
    text = markdown(summarise(_log(RECORDS).splitlines()))
    lines = text.splitlines()
    assert lines[0].startswith("| rule | backend | requests |")
    assert lines[-1].startswith("| **total** | | 4 | 1 | 1 | 1 | 0.000064 |")
    assert len(lines) == 2 + 3 + 1


def test_cost_report_command_reads_a_log_file(tmp_path: Path) -> None:
    log = tmp_path / "metrics.log"
    log.write_text(_log(RECORDS))
    result = CliRunner().invoke(CLI, ["cost", "report", str(log), "--format", "json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert rows == as_json(summarise(log.read_text().splitlines()))
    assert sum(r["requests"] for r in rows) == 4


def test_cost_report_command_fails_clearly_on_a_missing_file(tmp_path: Path) -> None:
    result = CliRunner().invoke(CLI, ["cost", "report", str(tmp_path / "none.log")])
    assert result.exit_code == 1
    assert "No such file" in result.output
