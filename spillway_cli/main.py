"""The ``spillway`` command: builds models, runs the demo, starts services.

The CLI wires and starts things; it is not part of the core, and the core never imports it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from spillway_cli.canary_cli import models_canary, models_status
from spillway_cli.capture_cli import capture_app
from spillway_cli.jobs_cli import jobs_app
from spillway_cli.models_add import models_add
from spillway_cli.models_cli import (
    models_list,
    models_promote,
    models_publish,
    models_remove,
    models_rollback,
    models_show,
)
from spillway_cli.ops_cli import dashboard, plan, policy_apply, tune
from spillway_cli.router_cli import cost_app, policy_app, serve_cpu, serve_router
from spillway_cli.tenants_cli import config_app, tenants_app
from spillway_cli.up_cli import RUNTIME_HELP, up

# Help in click's plain layout, for every command (the root's mode reaches each group and
# command): rich's option table shrinks its columns to the terminal and cuts long option
# names (`--policy-parameter` became `--policy-paramet…` at 80 columns); click's layout
# writes every name whole and wraps only the help text.
app = typer.Typer(
    help="Spillway: AI inference as a service.", no_args_is_help=True, rich_markup_mode=None
)
models_app = typer.Typer(
    help="Build, add, list, roll back, remove, publish and canary models.", no_args_is_help=True
)
serve_app = typer.Typer(help="Start a service in the foreground.", no_args_is_help=True)
app.add_typer(models_app, name="models")
app.add_typer(serve_app, name="serve")
app.add_typer(policy_app, name="policy")
app.add_typer(cost_app, name="cost")
app.add_typer(jobs_app, name="jobs")
app.add_typer(tenants_app, name="tenants")
app.add_typer(config_app, name="config")
app.add_typer(capture_app, name="capture")
serve_app.command("router")(serve_router)
models_app.command("add")(models_add)
models_app.command("list")(models_list)
models_app.command("show")(models_show)
models_app.command("rollback")(models_rollback)
models_app.command("remove")(models_remove)
models_app.command("publish")(models_publish)
models_app.command("canary")(models_canary)
models_app.command("promote")(models_promote)
models_app.command("status")(models_status)
serve_app.command("cpu")(serve_cpu)
app.command("dashboard")(dashboard)
app.command("plan")(plan)
app.command("tune")(tune)
app.command("up")(up)
policy_app.command("apply")(policy_apply)


def _logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


@models_app.command("build")
def models_build(
    out: Annotated[Path, typer.Option(help="Repository folder to write.")] = Path("models"),
    model: Annotated[list[str] | None, typer.Option(help="Build only these models.")] = None,
    verbose: bool = False,
) -> None:
    """Build the platform's models into a model repository (no downloads)."""
    from spillway_cli.modelbuild.build import build_repository

    _logging(verbose)
    reports = build_repository(out, model or None)
    for report in reports.values():
        metrics = ", ".join(f"{k}={v:.6g}" for k, v in report.metrics.items())
        typer.echo(f"{report.model:<10} {report.size_bytes / 1e6:8.2f} MB  {metrics}")


@app.command("demo")
def demo(
    models: Annotated[Path, typer.Option(help="Built model repository.")] = Path("models"),
    out: Annotated[Path, typer.Option(help="Logs, summary and chart.")] = Path("out/demo"),
    router_runtime: Annotated[str, typer.Option(help=RUNTIME_HELP)] = "auto",
    verbose: Annotated[bool, typer.Option(help="Also show log lines in the terminal.")] = False,
) -> None:
    """The whole platform on 127.0.0.1 with real traffic through the router."""
    from spillway_cli.console import report_logging
    from spillway_cli.demo.run import run_demo
    from spillway_cli.local.serverless_offline import router_runtime as resolve

    report_logging(out / "demo.log", verbose)
    run_demo(models, out, resolve(router_runtime), router_runtime == "auto")


@serve_app.command("gpu")
def serve_gpu(
    repository: Annotated[str | None, typer.Option(help="Folder or s3://bucket/prefix.")] = None,
    host: Annotated[str | None, typer.Option(help="Address to listen on.")] = None,
    port: Annotated[int | None, typer.Option(help="Port to listen on.")] = None,
    grpc_port: Annotated[
        int | None, typer.Option(help="Port of the KServe V2 gRPC service (unset: none).")
    ] = None,
    model_control_mode: Annotated[
        str | None, typer.Option(help="none | poll | explicit (Triton's meaning).")
    ] = None,
    repository_poll_secs: Annotated[
        float | None, typer.Option(help="Poll interval in poll mode.")
    ] = None,
) -> None:
    """The GPU service (Open Inference Protocol, dynamic batching); GPU_* variables apply."""
    from gpu_service.server import serve
    from gpu_service.settings import GpuSettings

    flags: dict[str, object] = {
        "repository": repository,
        "host": host,
        "port": port,
        "grpc_port": grpc_port,
        "model_control_mode": model_control_mode,
        "repository_poll_secs": repository_poll_secs,
    }
    serve(GpuSettings.model_validate({k: v for k, v in flags.items() if v is not None}))


@serve_app.command("jobs")
def serve_jobs(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8082,
    function_name: Annotated[
        str, typer.Option(help="Function name answered on Lambda's invoke API.")
    ] = "spillway-local-jobs",
) -> None:
    """The jobs API (the jobs Lambda as API Gateway calls it, and Lambda's invoke API for
    it, as the router's batch mode calls it on AWS); JOBS_* variables apply. Locally moto
    accepts the Batch job but runs nothing, so each new job's array children are run here
    as processes, as `spillway jobs submit --local` does."""
    from batch_job.api import answer, authenticator
    from batch_job.service import JobService
    from batch_job.settings import JobsSettings
    from spillway_cli.jobs_cli import run_submitted_locally
    from spillway_cli.local.lambda_http import wsgi_app
    from spillway_cli.local.wsgi_server import serve_forever

    _logging(False)
    jobs = JobService(JobsSettings())
    callers = authenticator(jobs.settings)
    served = wsgi_app(
        run_submitted_locally(lambda event, _context: answer(event, jobs, callers)),
        "/v1/health",
        function_name,
    )
    serve_forever(served, host, port)


@serve_app.command("websocket")
def serve_websocket(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8083,
    handler: Annotated[
        str, typer.Option(help="The Lambda handler, module.attribute.")
    ] = "functions.websocket.handler.handler",
    max_connections: Annotated[int, typer.Option(help="Open connections at most.")] = 1000,
    workers: Annotated[int, typer.Option(help="Handler invocations running at once.")] = 64,
) -> None:
    """The WebSocket API as API Gateway serves it ($connect, $default, $disconnect, each
    message invoked concurrently) and its @connections management API on the same port;
    the handler's own variables (WS_*, ROUTER_*) apply. WS_MANAGEMENT_ENDPOINT defaults to
    this server."""
    import os

    from spillway_cli.local.websocket.gateway import serve

    _logging(False)
    os.environ.setdefault("WS_MANAGEMENT_ENDPOINT", f"http://{host}:{port}")
    serve(handler, host, port, max_connections=max_connections, workers=workers)


if __name__ == "__main__":
    app()
