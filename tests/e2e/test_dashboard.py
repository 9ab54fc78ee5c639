"""The live dashboard in headless Chromium during a load run through the router.

GIVEN the local stack and its dashboard, WHEN digits requests of three kinds (default,
``realtime``, ``serverless``) run through the router, THEN the page refreshes live (its
request rate is above zero during the run) and, once the load ends, every figure on it
equals what the services themselves report: per backend, rule and route from the router's
metric lines (as ``spillway cost report`` reads them), and the GPU service's counters
from its ``/metrics``. The page loads nothing from anywhere but the dashboard, raises no
JavaScript error, and its screenshot is saved under ``out/dashboard/``.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from spillway.routing.accounting import nearest_rank, route_events
from spillway_cli.cost_report import summarise
from spillway_cli.dashboard.sources import GpuReading, parse_prometheus
from spillway_cli.demo import Client
from spillway_cli.stack import LocalStack
from tests.e2e.chromium import CHROMIUM, Browser

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "out" / "dashboard" / "dashboard.png"
LOAD_S = 6.0
KINDS: tuple[dict[str, str], ...] = (
    {},
    {"x-spillway-mode": "realtime"},
    {"x-spillway-mode": "serverless"},
)
PAGE_FIGURES = """JSON.stringify(Object.fromEntries(
  [...document.querySelectorAll('[data-metric]')].map(e => [e.dataset.metric, e.textContent])))"""


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


def expected_figures(stack: LocalStack) -> dict[str, str]:
    """What the page must show, computed from the services' own outputs."""
    lines = (stack.log_dir / "router-metrics.jsonl").read_text().splitlines()
    latencies: dict[str, list[float]] = defaultdict(list)
    requests: dict[str, int] = defaultdict(int)
    rules: dict[str, int] = defaultdict(int)
    for event in route_events(lines):
        latencies[event.backend] += event.latencies_ms
        requests[event.backend] += event.requests
        rules[event.rule] += event.requests
    figures = {"totals.requests": f"{sum(requests.values()):,}"}
    for backend, count in requests.items():
        figures[f"backend.{backend}.requests"] = f"{count:,}"
        figures[f"backend.{backend}.p50_ms"] = f"{nearest_rank(latencies[backend], 0.5):.1f}"
        figures[f"backend.{backend}.p99_ms"] = f"{nearest_rank(latencies[backend], 0.99):.1f}"
    for rule, count in rules.items():
        figures[f"rule.{rule}.requests"] = f"{count:,}"
    for route in summarise(lines):
        key = f"route.{route.rule}.{route.backend}"
        figures[f"{key}.requests"] = f"{route.requests:,}"
        figures[f"{key}.cost_usd"] = f"{route.cost_usd:.6f}"
    with urllib.request.urlopen(f"{stack.url('gpu')}/metrics", timeout=5) as response:
        gpu = GpuReading.of(parse_prometheus(response.read().decode()), 0.0)
    figures["gpu.success"] = f"{gpu.success:,.0f}"
    figures["gpu.batches"] = f"{gpu.batches:,.0f}"
    figures["gpu.mean_batch"] = f"{gpu.batch_rows / gpu.batches:.2f}"
    return figures


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

    expected = expected_figures(stack)
    shown: dict[str, str] = {}

    def matches() -> bool:
        shown.update(page_figures(browser))
        return all(shown.get(k) == v for k, v in expected.items())

    with contextlib.suppress(TimeoutError):
        browser.wait_for(matches, 15)
    assert {k: shown.get(k) for k in expected} == expected
    assert {"gpu", "cpu"} <= {k.split(".")[1] for k in expected if k.startswith("backend.")}
    assert {"default", "realtime", "serverless-requested"} <= {
        k.split(".")[1] for k in expected if k.startswith("rule.")
    }
    assert int(browser.evaluate("document.body.dataset.round")) > live_round
    assert shown["breaker.gpu"] == "closed"
    assert browser.exceptions() == []
    assert browser.requested_urls(), "the page requested nothing"
    assert all(url.startswith(f"{base}/") for url in browser.requested_urls())
    browser.screenshot(SCREENSHOT)
    assert SCREENSHOT.stat().st_size > 20_000
    assert time.monotonic() - started < 60
