"""``spillway up``: checks first (models built, ports free, the router runtime's needs),
each problem one line with its fix and a non-zero exit within seconds; then the parts
start, one progress line each as it comes up; then the stack env file that the other
commands read, the URLs and lines to try, until Ctrl-C or SIGTERM.

Registered by ``spillway_cli.main``.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Annotated

import typer

RUNTIME_HELP = "wsgi | serverless-offline | auto (serverless-offline when it can start)"
EXIT_CHECKS = 2
"""``up`` refused to start: a check failed (nothing was started)."""


def up(
    models: Annotated[Path, typer.Option(help="Built model repository to upload.")] = Path(
        "models"
    ),
    log_dir: Annotated[Path, typer.Option(help="Where the parts write their logs.")] = Path(
        "out/stack"
    ),
    router_port: Annotated[int, typer.Option(help="Router port (0: free).")] = 8080,
    gpu_port: Annotated[int, typer.Option(help="GPU service port (0: free).")] = 8000,
    gpu_grpc_port: Annotated[int, typer.Option(help="GPU service gRPC port (0: free).")] = 8001,
    cpu_port: Annotated[int, typer.Option(help="CPU fallback port (0: free).")] = 8081,
    jobs_port: Annotated[int, typer.Option(help="Jobs API port (0: free).")] = 8082,
    moto_port: Annotated[int, typer.Option(help="Moto (AWS) port (0: free).")] = 5000,
    dashboard_port: Annotated[int, typer.Option(help="Dashboard port (0: free).")] = 8090,
    websocket_port: Annotated[
        int, typer.Option(help="WebSocket API port (0: free, the default).")
    ] = 0,
    router_runtime: Annotated[str, typer.Option(help=RUNTIME_HELP)] = "auto",
    verbose: Annotated[bool, typer.Option(help="Also show log lines in the terminal.")] = False,
) -> None:
    """The whole platform on 127.0.0.1 until Ctrl-C or SIGTERM."""
    from spillway_cli import preflight
    from spillway_cli.local.serverless_offline import offline_missing

    ports = {
        "router": router_port,
        "gpu": gpu_port,
        "gpu_grpc": gpu_grpc_port,
        "cpu": cpu_port,
        "jobs": jobs_port,
        "moto": moto_port,
        "dashboard": dashboard_port,
        "websocket": websocket_port,
    }
    needs = offline_missing() if router_runtime == "serverless-offline" else []
    problems = preflight.problems(models, ports, router_runtime, needs)
    for problem in problems:
        typer.echo(f"error: {problem}", err=True)
    if problems:
        raise typer.Exit(EXIT_CHECKS)
    _run(models, log_dir, ports, router_runtime, verbose)


def _run(models: Path, log_dir: Path, ports: dict[str, int], runtime: str, verbose: bool) -> None:
    from spillway_cli.console import report_logging
    from spillway_cli.local.layout import Ports
    from spillway_cli.local.serverless_offline import router_runtime as resolve
    from spillway_cli.local.stack import LocalStack, StackError
    from spillway_cli.local.stackenv import stack_env_path

    report_logging(log_dir / "up.log", verbose)
    typer.echo(f"Starting Spillway (logs in {log_dir}/):")
    stack = LocalStack(
        models,
        log_dir,
        Ports(**ports),
        router_runtime=resolve(runtime),
        router_fallback=runtime == "auto",
        progress=typer.echo,
        env_path=stack_env_path(),
    )

    def stop(signum: int, _: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    started = time.monotonic()
    try:
        stack.start()
        typer.echo(f"Spillway is up in {time.monotonic() - started:.1f} s:\n{stack.summary()}")
        typer.echo(f"\nThe spillway commands find this stack through {stack.stack_env_path}.")
        typer.echo("Ctrl-C stops everything.")
        signal.pause()
    except StackError as exc:
        typer.echo(
            f"error: {exc.part} did not come up: {exc.reason} (log: {exc.log_path})", err=True
        )
        typer.echo("  " + exc.tail.replace("\n", "\n  "), err=True)
        raise typer.Exit(1) from None
    except (RuntimeError, TimeoutError) as exc:  # the router under serverless-offline
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        pass
    finally:
        stack.stop()
