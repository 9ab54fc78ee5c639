"""``spillway dashboard``: the live dashboard over the router's logs, the services' own
metrics and the operator's stores. Heavy imports happen inside the command.

What no flag names comes from the environment, else from the stack env file of a running
``spillway up`` (``spillway_cli.local.stackenv``), as the other commands take it: the router's
metrics log and log, the GPU and CPU URLs, the state table, the policy, the jobs table and
the ``ASYNC_*`` settings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any

import typer


def _fail(message: str) -> typer.Exit:
    typer.echo(message, err=True)
    return typer.Exit(1)


def _base_url(option: str, url: str | None) -> str | None:
    if url is not None and not url.startswith(("http://", "https://")):
        raise _fail(f"{option} must be an http(s) URL")
    return url.rstrip("/") if url else None


def dashboard(
    log: Annotated[
        list[Path] | None,
        typer.Option(
            help="A router log or metrics log (EMF lines, decision lines); repeat. "
            "Default: the running stack's."
        ),
    ] = None,
    gpu_url: Annotated[
        str | None, typer.Option(help="GPU service base URL; its /metrics is scraped.")
    ] = None,
    cpu_url: Annotated[
        str | None, typer.Option(help="CPU fallback base URL (its versions, its starts).")
    ] = None,
    state_table: Annotated[
        str | None,
        typer.Option(envvar="ROUTER_STATE_TABLE", help="The routers' state table (canaries)."),
    ] = None,
    policy_file: Annotated[
        Path | None, typer.Option(help="The policy file the router reads (ROUTER_POLICY_FILE).")
    ] = None,
    policy_parameter: Annotated[
        str | None, typer.Option(help="The SSM parameter the router reads its policy from.")
    ] = None,
    slo: Annotated[
        Path | None, typer.Option(help="p99 objectives per route (the tuner's SLO file).")
    ] = None,
    jobs_table: Annotated[
        str | None, typer.Option(help="The jobs table (JOBS_TABLE): recent batch jobs.")
    ] = None,
    async_backlog: Annotated[
        bool, typer.Option(help="Show the async backlog (the ASYNC_* settings name it).")
    ] = True,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8090,
    interval: Annotated[float, typer.Option(min=0.2, help="Seconds between refreshes.")] = 1.0,
    window: Annotated[
        int, typer.Option(min=60, max=86_400, help="Seconds of history in the charts.")
    ] = 3600,
) -> None:
    """The live dashboard in the browser: requests, 5xx and 4xx, latency against the SLO
    and load per backend and model, routing by rule, GPU queue and batches, circuits, CPU
    starts and concurrency, canaries and served versions, the policy in force, the async
    backlog, batch jobs, fallbacks, spills and cost per route."""
    from spillway.async_inference.settings import AsyncSettings
    from spillway.policy.store import FileSource, PolicySource, SsmSource
    from spillway_cli.dashboard.board import Board
    from spillway_cli.dashboard.operator import Operator
    from spillway_cli.dashboard.server import DashboardApp, Poller
    from spillway_cli.dashboard.sources import RouterLogs
    from spillway_cli.local.wsgi_server import serve_forever

    if policy_file is not None and policy_parameter is not None:
        raise _fail("give --policy-file or --policy-parameter, not both")
    given = Sources(
        list(log or []), gpu_url, cpu_url, state_table, policy_file, policy_parameter, jobs_table
    )
    found = with_stack_defaults(given)
    if not found.logs:
        raise _fail("no router log: pass --log (or start a local stack with `spillway up`)")
    gpu = _base_url("--gpu-url", found.gpu_url)
    cpu = _base_url("--cpu-url", found.cpu_url)
    source: PolicySource | None = None
    if found.policy_file is not None:
        source = FileSource(found.policy_file)
    elif found.policy_parameter is not None:
        source = SsmSource(found.policy_parameter)
    settings = AsyncSettings.from_env() if async_backlog else None
    operator = Operator(
        state_table=found.state_table,
        policy=source,
        backends={name: url for name, url in (("gpu", gpu), ("cpu", cpu)) if url},
        async_settings=settings if settings is not None and settings.enabled else None,
        jobs_table=found.jobs_table,
        jobs_status=_jobs_status(found.jobs_table) if found.jobs_table else None,
    )
    board = Board(window_s=window, slo=load_slo(slo) if slo else None)
    metrics = f"{gpu}/metrics" if gpu else None
    logs = RouterLogs(found.logs)
    poller = Poller(board, logs, metrics, interval_s=interval, operator=operator)
    poller.start()
    try:
        serve_forever(DashboardApp(poller), host, port)
    finally:
        poller.stop()


@dataclass(frozen=True)
class Sources:
    """Where the dashboard reads (``None``: that part is not shown)."""

    logs: list[Path]
    gpu_url: str | None = None
    cpu_url: str | None = None
    state_table: str | None = None
    policy_file: Path | None = None
    policy_parameter: str | None = None
    jobs_table: str | None = None


def with_stack_defaults(given: Sources) -> Sources:
    """``given`` with what it lacks from the environment, else from the running stack's
    env file: flags win, then variables already set, then the stack's."""
    from spillway_cli.local.stackenv import use_stack_env

    use_stack_env()
    env = os.environ.get
    logs = given.logs or list(
        dict.fromkeys(
            Path(p) for p in (env("SPILLWAY_METRICS_LOG"), env("SPILLWAY_ROUTER_LOG")) if p
        )
    )
    policy: dict[str, Any] = {}
    if given.policy_file is None and given.policy_parameter is None:
        stack_file = env("SPILLWAY_POLICY_FILE")
        policy["policy_file"] = Path(stack_file) if stack_file else None
        policy["policy_parameter"] = None if stack_file else env("SPILLWAY_POLICY_PARAMETER")
    return replace(
        given,
        logs=logs,
        gpu_url=given.gpu_url or env("SPILLWAY_GPU_URL"),
        cpu_url=given.cpu_url or env("SPILLWAY_CPU_URL"),
        state_table=given.state_table or env("ROUTER_STATE_TABLE"),
        jobs_table=given.jobs_table or env("JOBS_TABLE"),
        **policy,
    )


def load_slo(path: Path) -> dict[str, Any]:
    """The tuner's SLO file, checked as the tuner checks it."""
    from spillway_cli.plan.inputs import load_model
    from spillway_cli.tune.search import Slo

    try:
        objectives: Slo = load_model(Slo, path)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    return objectives.model_dump()


def _jobs_status(table: str) -> Any:
    """Any tenant's job status, as ``spillway jobs status`` (the operator) reads it."""
    from batch_job.service import JobService
    from batch_job.settings import JobsSettings

    return JobService(JobsSettings(table=table)).status_as_operator
