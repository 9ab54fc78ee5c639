"""``spillway dashboard``: the live dashboard over the router's logs, the services' own
metrics and the operator's stores. Heavy imports happen inside the command."""

from __future__ import annotations

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
        list[Path],
        typer.Option(help="A router log or metrics log (EMF lines, decision lines); repeat."),
    ],
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
    from spillway.routing.policy_store import FileSource, PolicySource, SsmSource
    from spillway_cli.dashboard.board import Board
    from spillway_cli.dashboard.operator import Operator
    from spillway_cli.dashboard.server import DashboardApp, Poller
    from spillway_cli.dashboard.sources import RouterLogs
    from spillway_cli.wsgi_server import serve_forever

    gpu = _base_url("--gpu-url", gpu_url)
    cpu = _base_url("--cpu-url", cpu_url)
    if policy_file is not None and policy_parameter is not None:
        raise _fail("give --policy-file or --policy-parameter, not both")
    source: PolicySource | None = None
    if policy_file is not None:
        source = FileSource(policy_file)
    elif policy_parameter is not None:
        source = SsmSource(policy_parameter)
    settings = AsyncSettings.from_env() if async_backlog else None
    operator = Operator(
        state_table=state_table,
        policy=source,
        backends={name: url for name, url in (("gpu", gpu), ("cpu", cpu)) if url},
        async_settings=settings if settings is not None and settings.enabled else None,
        jobs_table=jobs_table,
        jobs_status=_jobs_status(jobs_table) if jobs_table else None,
    )
    board = Board(window_s=window, slo=load_slo(slo) if slo else None)
    metrics = f"{gpu}/metrics" if gpu else None
    poller = Poller(board, RouterLogs(log), metrics, interval_s=interval, operator=operator)
    poller.start()
    try:
        serve_forever(DashboardApp(poller), host, port)
    finally:
        poller.stop()


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
