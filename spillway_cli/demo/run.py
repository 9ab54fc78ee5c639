"""``spillway demo`` (``make demo``): the stack brought up, every section run through the
router in order, each followed by its checks, the stack stopped; exit 1 naming every
failed check (the sections and what they check: ``spillway_cli.demo``; their order
and numbers: ``spillway_cli.demo.sections``)."""

from __future__ import annotations

import signal
from pathlib import Path

import typer

from spillway_cli.console import CheckFailed, Checks
from spillway_cli.demo.client import Client, failed
from spillway_cli.demo.report import apart, chart, say, summary
from spillway_cli.demo.sections import CANARY, Demo, number, recorded, run_sections
from spillway_cli.local.serverless_offline import offline_missing
from spillway_cli.local.stack import LocalStack


def _interrupted(signum: int, _: object) -> None:
    raise KeyboardInterrupt


def run_demo(
    models: Path, out: Path, router_runtime: str = "wsgi", router_fallback: bool = False
) -> None:
    """Bring the stack up, run every scenario through the router, stop everything; exit
    1 naming every failed check."""
    checks = Checks(say)
    say(f"Starting the platform on 127.0.0.1 (logs: {out / 'demo.log'}, {out / 'stack'}) ...")
    # The deployed stack's rules on every runtime: the router refuses a request without
    # the local stage's API key (403), and the demo's calls carry it (stack.router_headers).
    stack = LocalStack(
        models,
        out / "stack",
        router_runtime=router_runtime,
        router_fallback=router_fallback,
        check_api_keys=True,
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
        say(f"Live dashboard: {stack.url('dashboard')}/")
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
    """Every section, in order, each followed by its checks; then the summary per backend
    of the recorded ones, the canary's failures apart, and the chart."""
    demo = Demo(stack, client, models, out, checks, say)
    run_sections(demo)
    covered = recorded()
    say(f"\nSummary per backend ({covered}):\n" + summary(client))
    checks.record(f"summary ({covered})", [failed(client.records)])
    if demo.canary is not None:
        say(apart(demo.canary, number(CANARY)))
    chart(client, out / "demo.png")
    say(f"\nChart: {out / 'demo.png'}")
