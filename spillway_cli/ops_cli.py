"""CLI for operating the platform: the live dashboard, the capacity and cost planner, the
policy tuner, and applying a policy.

Registered by ``spillway_cli.main``: ``spillway dashboard``, ``spillway plan``, ``spillway
tune`` and ``spillway policy apply``. Heavy imports happen inside each command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from spillway_cli.dashboard.command import dashboard as dashboard

MeasuredFile = Annotated[
    Path | None, typer.Option(help="Measured inputs (default config/measured.yaml).")
]
PricingFile = Annotated[
    Path | None, typer.Option(help="The router's pricing (default config/pricing.yaml).")
]
PricesFile = Annotated[
    Path | None, typer.Option(help="Price table (default config/plan-prices.yaml).")
]


def _fail(message: str) -> typer.Exit:
    typer.echo(message, err=True)
    return typer.Exit(1)


def plan(
    profile: Annotated[Path, typer.Option(help="Traffic profile (YAML): the workloads.")],
    measured: MeasuredFile = None,
    pricing: PricingFile = None,
    prices: PricesFile = None,
    chart: Annotated[
        Path | None, typer.Option(help="Write the cost-against-traffic chart (PNG) here.")
    ] = Path("out/plan/plan.png"),
    output: Annotated[str, typer.Option("--format", help="markdown or json.")] = "markdown",
) -> None:
    """Serverless, dedicated, batch and routed-mix costs per month of each workload, the
    latency each meets, the GPU tasks and Lambda concurrency it needs, and the break-even."""
    import json

    from spillway_cli.plan import inputs, report
    from spillway_cli.plan.model import Profile

    if output not in ("markdown", "json"):
        raise _fail("--format must be markdown or json")
    try:
        traffic: Profile = inputs.load_model(Profile, profile)
        figures = inputs.load_measured(measured or inputs.MEASURED)
        table = inputs.load_prices(pricing or inputs.ROUTER_PRICING, prices or inputs.PLAN_PRICES)
        plans = report.make_plan(traffic, figures, table)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    if output == "json":
        typer.echo(json.dumps(report.as_json(plans), indent=2))
    else:
        typer.echo(report.table(plans, figures, table))
    if chart is not None:
        written = report.chart(plans, figures, table, chart)
        typer.echo(f"\nChart: {written}", err=output == "json")


def tune(
    metrics: Annotated[
        list[Path], typer.Option(help="The router's metrics log (EMF lines); repeat.")
    ],
    policy: Annotated[Path, typer.Option(help="The policy in force while it was recorded.")],
    slo: Annotated[Path, typer.Option(help="p99 objectives per route (YAML).")],
    out: Annotated[Path, typer.Option(help="Where to write the proposed policy.")] = Path(
        "out/tune/policy.yaml"
    ),
    measured: MeasuredFile = None,
    pricing: PricingFile = None,
    prices: PricesFile = None,
    gpu_tasks: Annotated[int, typer.Option(min=1, help="GPU tasks while it was recorded.")] = 1,
    bin_s: Annotated[float, typer.Option(min=1, help="Seconds per replay step.")] = 10.0,
    seed: Annotated[int, typer.Option(help="Seed of the replayed spill draws.")] = 7,
) -> None:
    """Replay the recorded traffic through candidate policies and propose the cheapest
    one that keeps every route's SLO; writes it, never applies it."""
    from spillway_cli.tune.session import TuneError, run_tune

    try:
        tuned = run_tune(
            metrics, policy, slo, out, measured, pricing, prices, gpu_tasks, bin_s, seed
        )
        typer.echo(tuned.report)
    except TuneError as exc:
        typer.echo(str(exc.report))
        raise _fail(str(exc)) from None
    except ValueError as exc:
        raise _fail(str(exc)) from None


def policy_apply(
    file: Annotated[Path, typer.Argument(help="The policy to apply (YAML or JSON).")],
    to_file: Annotated[
        Path | None, typer.Option("--file", help="Replace this policy file (local router).")
    ] = None,
    parameter: Annotated[
        str | None, typer.Option(help="Put it in this SSM parameter (the router on AWS).")
    ] = None,
) -> None:
    """Apply a policy: validated first, then written to the router's policy file or SSM
    parameter, which the router picks up within ROUTER_POLICY_TTL_S. Without either flag,
    the policy of the stack `spillway up` runs."""
    import os
    import tempfile

    from spillway.policy.rules import PolicyError, parse_policy
    from spillway_cli.local.stackenv import aws_errors, require_aws, use_stack_env

    if to_file is None and parameter is None:
        use_stack_env()
        stack_file = os.environ.get("SPILLWAY_POLICY_FILE")
        to_file = Path(stack_file) if stack_file else None
        parameter = None if stack_file else os.environ.get("SPILLWAY_POLICY_PARAMETER")
    if (to_file is None) == (parameter is None):
        raise _fail("give exactly one of --file and --parameter (or start `spillway up`)")
    try:
        text = file.read_text(encoding="utf-8")
        policy = parse_policy(text, str(file))
    except (OSError, PolicyError) as exc:
        raise _fail(str(exc)) from None
    if to_file is not None:
        # Written beside the target and renamed over it: the router never reads half a file.
        handle, temporary = tempfile.mkstemp(dir=to_file.parent, prefix=f".{to_file.name}.")
        with os.fdopen(handle, "w", encoding="utf-8") as written:
            written.write(text)
        os.replace(temporary, to_file)
        typer.echo(f"applied {file} ({len(policy.rules)} rules) to {to_file}")
        return
    from spillway.aws.clients import aws_client

    require_aws()
    with aws_errors():
        aws_client("ssm").put_parameter(Name=parameter, Value=text, Type="String", Overwrite=True)
    typer.echo(f"applied {file} ({len(policy.rules)} rules) to SSM parameter {parameter}")
