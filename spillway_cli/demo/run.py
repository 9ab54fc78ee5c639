"""``spillway demo`` (``make demo``): the stack brought up, every section run through the
router in order, each followed by its checks, the stack stopped; exit 1 naming every
failed check (the sections and what they check: ``spillway_cli.demo``)."""

from __future__ import annotations

import signal
from pathlib import Path

import typer

from spillway_cli.console import CheckFailed, Checks
from spillway_cli.demo.async_requests import scenario_async
from spillway_cli.demo.batch import scenario_batch
from spillway_cli.demo.canary import scenario_canary
from spillway_cli.demo.client import Client, failed
from spillway_cli.demo.faults import scenario_hot_swap, scenario_kill_gpu
from spillway_cli.demo.pipelines import scenario_topics
from spillway_cli.demo.report import apart, chart, say, summary
from spillway_cli.demo.serving import scenario_digits, scenario_minilm, scenario_serverless
from spillway_cli.demo.streams import scenario_frame_streams
from spillway_cli.local.serverless_offline import offline_missing
from spillway_cli.local.stack import LocalStack

ASYNC_LIMIT_S = 300.0
"""How long the async section's requests may take to finish."""


def _interrupted(signum: int, _: object) -> None:
    raise KeyboardInterrupt


def run_demo(
    models: Path, out: Path, router_runtime: str = "wsgi", router_fallback: bool = False
) -> None:
    """Bring the stack up, run every scenario through the router, stop everything; exit
    1 naming every failed check."""
    checks = Checks(say)
    say(f"Starting the platform on 127.0.0.1 (logs: {out / 'demo.log'}, {out / 'stack'}) ...")
    stack = LocalStack(
        models, out / "stack", router_runtime=router_runtime, router_fallback=router_fallback
    )
    signal.signal(signal.SIGTERM, _interrupted)  # the stack's processes stop with the demo
    try:
        stack.start()
        say("Spillway is up:\n" + stack.summary() + "\n")
        missing = offline_missing() if stack.router_runtime == "wsgi" else []
        why = f" (serverless-offline needs {', '.join(missing)})" if missing else ""
        if router_runtime != stack.router_runtime:
            why = f" (it did not come up under {router_runtime}: see {stack.log_dir}/router.log)"
        say(f"The router runs as {stack.router_runtime}{why}.")
        say(f"Live dashboard: {stack.url('dashboard')}/\n")
        client = Client(stack.ports.router, dict(stack.router_headers))
        _scenarios(stack, client, models, out, checks)
    except CheckFailed:
        pass  # printed as it was recorded; the verdict below names it again
    finally:
        stack.stop()
    say("\n" + checks.verdict())
    if checks.failed:
        raise typer.Exit(1)


def _scenarios(stack: LocalStack, client: Client, models: Path, out: Path, checks: Checks) -> None:
    """Every section, in order, each followed by its checks."""
    checks.record("1. digits", scenario_digits(client, models))
    checks.record("2. minilm", scenario_minilm(client))
    checks.record("3. serverless", scenario_serverless(client))
    scenario_batch(stack, models, out, checks)
    scenario_kill_gpu(client, stack, checks)
    checks.record("6. hot swap", scenario_hot_swap(client, stack, models))
    canary = scenario_canary(stack, models, say)
    checks.record("7. canary (fails on purpose)", canary.checks())
    asynchronous = scenario_async(
        stack.ports.router, dict(stack.router_headers), models, say, timeout_s=ASYNC_LIMIT_S
    )
    checks.record("8. async", asynchronous.checks())
    topics = scenario_topics(stack.ports.router, dict(stack.router_headers), say)
    checks.record("9. topics", topics.checks())
    checks.record("10. frame streams", scenario_frame_streams(stack, models))
    say("\nSummary per backend (sections 1-6):\n" + summary(client))
    checks.record("summary (sections 1-6)", [failed(client.records)])
    say(apart(canary))
    chart(client, out / "demo.png")
    say(f"\nChart: {out / 'demo.png'}")
