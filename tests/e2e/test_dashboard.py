"""The live dashboard in headless Chromium during a load run through the router.

GIVEN the local stack and its dashboard, WHEN digits requests of three kinds (default,
``realtime``, ``serverless``) run through the router, then 26 requests for a model nobody
serves, a canary started with ``spillway models canary`` and a batch job, THEN the page
refreshes live (its request rate is above zero during the run) and every figure on it
equals what the services and stores themselves report: per backend, rule, route and
model (with 4xx apart from 5xx, and the CPU fallback's requests in flight) from the
router's metric lines (as ``spillway cost report`` reads them), the GPU service's counters
from its ``/metrics``, the canary from the state table, each backend's served versions
from its ``/v2/models/M``, the policy in force from the file the router reads (whose
digest the router logged), the async backlog from the async table, the job's state as
``spillway jobs status`` reads it, and one start of the CPU fallback process. The page
loads nothing from anywhere but the dashboard, raises no JavaScript error, and its
screenshot is saved under ``out/dashboard/``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from batch_job.service import JobService
from batch_job.settings import JobsSettings
from spillway.async_inference.settings import AsyncSettings
from spillway.async_inference.store import AsyncStore
from spillway.aws.clients import aws_client
from spillway.canary.records import CanaryStore
from spillway.policy.accounting import nearest_rank, route_document, route_events
from spillway.policy.rules import parse_policy
from spillway.state.table import DynamoStateStore, scope
from spillway_cli.cost_report import summarise
from spillway_cli.dashboard.board import Board
from spillway_cli.dashboard.command import load_slo
from spillway_cli.dashboard.server import DashboardApp, Poller
from spillway_cli.dashboard.sources import GpuReading, Request, RouterLogs, parse_prometheus
from spillway_cli.demo.client import Client
from spillway_cli.local.names import STATE_TABLE
from spillway_cli.local.stack import LocalStack
from spillway_cli.local.wsgi_server import running
from tests.e2e.chromium import CHROMIUM, Browser

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "out" / "dashboard" / "dashboard.png"
LOAD_S = 6.0
KINDS: tuple[dict[str, str], ...] = (
    {},
    {"x-spillway-mode": "realtime"},
    {"x-spillway-mode": "serverless"},
)
MISSING = 26
"""Requests for a model nobody serves: each is a 404 to its client."""
CANARY_MODEL = "mlp-bench"
"""A model the load does not use: its canary (a version that does not exist) sends none
of this test's requests anywhere, and its record is deleted at the end."""
PAGE_FIGURES = """JSON.stringify({_now: document.body.dataset.now, ...Object.fromEntries(
  [...document.querySelectorAll('[data-metric]')].map(e => [e.dataset.metric, e.textContent]))})"""


@pytest.fixture
def browser() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        message = f"{CHROMIUM} is not installed (Debian package chromium)"
        if os.environ.get("SPILLWAY_REQUIRE_BROWSER") == "1":
            pytest.fail(message)
        pytest.skip(message)
    launched = Browser.launch()
    try:
        yield launched
    finally:
        launched.close()


def run_load(stack: LocalStack, stop: threading.Event, threads: int = 4) -> list[int]:
    """Requests of every kind from ``threads`` clients until ``stop``; their statuses."""
    client = Client(stack.ports.router, dict(stack.router_headers))
    statuses: list[int] = []

    def worker(seed: int) -> None:
        images = np.random.default_rng(seed).random((64, 1, 8, 8)).astype(np.float32) * 16
        i = 0
        while not stop.is_set():
            kind = KINDS[i % len(KINDS)]
            status, _, _ = client.infer("dashboard", "digits", {"image": images[i % 64]}, kind)
            statuses.append(status)
            i += 1

    pool = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
    for thread in pool:
        thread.start()
    stop.wait(LOAD_S)
    stop.set()
    for thread in pool:
        thread.join(30)
    return statuses


def expected_figures(stack: LocalStack, now: float, job_id: str) -> dict[str, str]:
    """What the page must show, computed from the services' and stores' own outputs
    (``now``: the moment of the page's snapshot, for the figures over recent seconds)."""
    lines = (stack.log_dir / "router-metrics.jsonl").read_text().splitlines()
    latencies: dict[str, list[float]] = defaultdict(list)
    requests: dict[str, int] = defaultdict(int)
    rules: dict[str, int] = defaultdict(int)
    models: dict[str, int] = defaultdict(int)
    model_4xx: dict[str, int] = defaultdict(int)
    recent_cpu_ms = 0.0
    for event in route_events(lines):
        latencies[event.backend] += event.latencies_ms
        requests[event.backend] += event.requests
        rules[event.rule] += event.requests
        models[event.model] += event.requests
        if event.backend == "cpu" and int(now) - 10 <= int(event.at) < int(now):
            recent_cpu_ms += sum(event.latencies_ms)
    statuses = [Request.of(d) for d in map(route_document, lines) if d is not None]
    for request in statuses:
        model_4xx[request.event.model] += 400 <= request.status < 500
    figures = {
        "totals.requests": f"{sum(requests.values()):,}",
        "totals.client_errors": f"{sum(400 <= r.status < 500 for r in statuses):,}",
        "totals.errors": f"{sum(r.status >= 500 for r in statuses):,}",
        "cpu.concurrency": f"{recent_cpu_ms / 1000 / 10:.2f}",
    }
    for backend, count in requests.items():
        figures[f"backend.{backend}.requests"] = f"{count:,}"
        figures[f"backend.{backend}.p50_ms"] = f"{nearest_rank(latencies[backend], 0.5):.1f}"
        figures[f"backend.{backend}.p99_ms"] = f"{nearest_rank(latencies[backend], 0.99):.1f}"
    for rule, count in rules.items():
        figures[f"rule.{rule}.requests"] = f"{count:,}"
    for model, count in models.items():
        figures[f"model.{model}.requests"] = f"{count:,}"
        figures[f"model.{model}.client_errors"] = f"{model_4xx[model]:,}"
    for route in summarise(lines):
        key = f"route.{route.rule}.{route.backend}"
        figures[f"{key}.requests"] = f"{route.requests:,}"
        figures[f"{key}.cost_usd"] = f"{route.cost_usd:.6f}"
    with urllib.request.urlopen(f"{stack.url('gpu')}/metrics", timeout=5) as response:
        gpu = GpuReading.of(parse_prometheus(response.read().decode()), 0.0)
    figures["gpu.success"] = f"{gpu.success:,.0f}"
    figures["gpu.batches"] = f"{gpu.batches:,.0f}"
    figures["gpu.mean_batch"] = f"{gpu.batch_rows / gpu.batches:.2f}"
    return figures | operator_figures(stack, job_id)


def served(base: str, model: str) -> str:
    """A backend's versions of ``model`` as the page writes them."""
    try:
        with urllib.request.urlopen(f"{base}/v2/models/{model}", timeout=10) as response:
            versions = json.loads(response.read())["versions"]
    except urllib.error.HTTPError as exc:
        return "not served" if exc.code == 404 else f"HTTP {exc.code}"
    return ", ".join(versions) if versions else "none"


def operator_figures(stack: LocalStack, job_id: str) -> dict[str, str]:
    """The canary, served versions, policy, backlog, job and process starts, each read
    from its own store or service."""
    state = CanaryStore(DynamoStateStore(STATE_TABLE, lambda: aws_client("dynamodb")), time.time)
    canary = state.load(CANARY_MODEL)
    assert canary is not None
    policy_text = Path(stack.router_env()["ROUTER_POLICY_FILE"]).read_text()
    backlog = list(AsyncStore(AsyncSettings.from_env(stack.aws_env())).pending(1000))
    job = JobService(JobsSettings()).status_as_operator(job_id)
    figures = {
        f"model.{CANARY_MODEL}.canary": f"v{canary.canary} {canary.percent:g}% "
        f"(stable v{canary.stable})",
        "policy.digest": hashlib.sha256(policy_text.encode()).hexdigest()[:16],
        "async.pending": f"{len(backlog):,}",
        f"job.{job_id}.state": job.state,
        f"job.{job_id}.tenant": scope(None)[:12],
        "backend.cpu.starts": "1",
        "starts.cpu process": "1",
    }
    for i, rule in enumerate(parse_policy(policy_text, "policy").rules, start=1):
        figures[f"policy.rule.{i}"] = rule.name
    for model in ("digits", CANARY_MODEL):
        for backend in ("gpu", "cpu"):
            figures[f"model.{model}.versions.{backend}"] = served(stack.url(backend), model)
    return figures


def start_canary(stack: LocalStack) -> None:
    """``spillway models canary`` as an operator runs it against the stack."""
    argv = [sys.executable, "-m", "spillway_cli.main", "models", "canary"]
    argv += ["--model", CANARY_MODEL, "--version", "2", "--stable", "1", "--percent", "25"]
    argv += ["--table", STATE_TABLE]
    env = {**os.environ, **stack.aws_env()}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr


def end_canary() -> None:
    table = DynamoStateStore(STATE_TABLE, lambda: aws_client("dynamodb"))
    table.delete(CanaryStore.key(CANARY_MODEL), time.time())


def submit_job(stack: LocalStack) -> str:
    """A batch-mode request through the router: the job id it answers."""
    images = np.random.default_rng(3).random((4, 8, 8)).astype(np.float32) * 16
    client = Client(stack.ports.router, dict(stack.router_headers))
    status, _, raw = client.infer(
        "dashboard", "digits", {"image": images}, {"x-spillway-mode": "batch"}
    )
    assert status == 202, raw
    job_id: str = json.loads(raw)["job_id"]
    return job_id


def page_figures(browser: Browser) -> dict[str, str]:
    figures: dict[str, str] = json.loads(browser.evaluate(PAGE_FIGURES))
    return figures


def shows_traffic(browser: Browser) -> bool:
    rate = page_figures(browser).get("totals.rps", "")
    return rate.replace(".", "", 1).isdigit() and float(rate) > 0


def test_dashboard_shows_the_services_numbers(stack: LocalStack, browser: Browser) -> None:
    started = time.monotonic()
    base = stack.url("dashboard")
    browser.goto(f"{base}/")
    stop = threading.Event()
    result: list[list[int]] = []
    load = threading.Thread(target=lambda: result.append(run_load(stack, stop)))
    load.start()
    try:
        # Live: during the run the page shows traffic arriving.
        browser.wait_for(lambda: shows_traffic(browser), 20)
        live_round = int(browser.evaluate("document.body.dataset.round"))
    finally:
        load.join(60)
    statuses = result[0]
    assert len(statuses) > 50
    assert set(statuses) == {200}

    # WHEN clients ask for a model nobody serves, an operator starts a canary, and a
    # caller asks for batch mode
    client = Client(stack.ports.router, dict(stack.router_headers))
    image = {"image": np.zeros((8, 8), dtype=np.float32)}
    missing = [client.infer("dashboard", "no-such-model", image)[0] for _ in range(MISSING)]
    assert missing == [404] * MISSING
    start_canary(stack)
    try:
        job_id = submit_job(stack)
        shown: dict[str, str] = {}
        expected: dict[str, str] = {}

        def matches() -> bool:
            shown.update(page_figures(browser))
            now = float(shown["_now"]) if shown.get("_now") else time.time()
            expected.update(expected_figures(stack, now, job_id))
            return all(shown.get(k) == v for k, v in expected.items())

        with contextlib.suppress(TimeoutError):
            browser.wait_for(matches, 20)
        assert {k: shown.get(k) for k in expected} == expected
    finally:
        end_canary()
    assert {"gpu", "cpu"} <= {k.split(".")[1] for k in expected if k.startswith("backend.")}
    assert {"default", "realtime", "serverless-requested"} <= {
        k.split(".")[1] for k in expected if k.startswith("rule.")
    }
    # THEN the 404s show as client errors (the router's lines name no model for them)
    assert int(shown["model.-.client_errors"].replace(",", "")) >= MISSING
    assert shown[f"model.{CANARY_MODEL}.canary"] == "v2 25% (stable v1)"
    assert shown["policy.digest"] in (stack.log_dir / "router.log").read_text()
    assert int(browser.evaluate("document.body.dataset.round")) > live_round
    assert shown["breaker.gpu"] == "closed"
    assert browser.exceptions() == []
    assert browser.requested_urls(), "the page requested nothing"
    assert all(url.startswith(f"{base}/") for url in browser.requested_urls())
    browser.screenshot(SCREENSHOT)
    assert SCREENSHOT.stat().st_size > 20_000
    assert time.monotonic() - started < 60


LEGEND = """JSON.stringify([...document.querySelectorAll('#chart-latency .u-legend th')]
  .map(e => e.textContent.trim()))"""
SLO_CELLS = """JSON.stringify(Object.fromEntries(
  [...document.querySelectorAll('[data-metric$=".slo"]')]
  .map(e => [e.dataset.metric, [e.textContent, e.className]])))"""


def test_slo_objectives_are_lines_on_the_latency_chart_and_marks_on_routes(
    stack: LocalStack, browser: Browser, tmp_path: Path
) -> None:
    # GIVEN the tuner's SLO file for the dashboard (``spillway dashboard --slo``)
    slo = tmp_path / "slo.yaml"
    slo.write_text("routes:\n  default: 50\n  realtime: 20\ndefault_p99_ms: 400\n")
    objectives = {"default": 50.0, "realtime": 20.0}
    metrics = stack.log_dir / "router-metrics.jsonl"
    poller = Poller(Board(slo=load_slo(slo)), RouterLogs([metrics]), None, interval_s=0.5)
    poller.start()
    try:
        with running(DashboardApp(poller)) as url:
            browser.goto(f"{url}/")
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            routes = summarise(lines)
            rules = {r.rule for r in routes} or set(objectives)
            # THEN each rule's objective is a line, and a route over it is marked
            latencies: dict[tuple[str, str], list[float]] = defaultdict(list)
            for event in route_events(lines):
                latencies[event.rule, event.backend] += event.latencies_ms
            want_cells = {}
            for (rule, backend), values in latencies.items():
                limit = objectives.get(rule, 400.0)
                over = "over" if nearest_rank(values, 0.99) > limit else ""
                want_cells[f"route.{rule}.{backend}.slo"] = [f"{limit:.1f}", over]
            want_lines = {f"SLO {rule} p99" for rule in rules}

            def drawn() -> bool:
                legend = set(json.loads(browser.evaluate(LEGEND)))
                return (
                    want_lines <= legend and json.loads(browser.evaluate(SLO_CELLS)) == want_cells
                )

            with contextlib.suppress(TimeoutError):
                browser.wait_for(drawn, 15)
            assert want_lines <= set(json.loads(browser.evaluate(LEGEND)))
            assert json.loads(browser.evaluate(SLO_CELLS)) == want_cells
            assert browser.exceptions() == []
    finally:
        poller.stop()
