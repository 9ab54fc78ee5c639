"""``spillway up``: one stack per folder — a second ``up`` where one runs names it and
changes nothing —, then checks (models built, ports free — or held by another folder's
stack, named —, the router runtime's needs), each problem one line with its fix and a
non-zero exit within seconds; then the router's runtime and why, the parts, one progress
line each as it comes up, with what the stack kept from its last run; then the stack env
file that the other commands read, the URLs and lines to try, until Ctrl-C or SIGTERM,
and what it keeps for the next run as it stops.

Registered by ``spillway_cli.main``.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NamedTuple

import typer

if TYPE_CHECKING:
    from spillway_cli.local.running import StackRecord, StackRunning
    from spillway_cli.local.stack import LocalStack

RUNTIME_HELP = "wsgi | serverless-offline | auto (serverless-offline when it can start)"
EXIT_CHECKS = 2
"""``up`` refused to start: a check failed (nothing was started)."""


def up(
    models: Annotated[Path, typer.Option(help="Built model repository to upload.")] = Path(
        "models"
    ),
    log_dir: Annotated[
        Path, typer.Option(help="Where the parts write their logs and the stack keeps its state.")
    ] = Path("out/stack"),
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
    traces_port: Annotated[
        int, typer.Option(help="Trace receiver (OTLP/HTTP) and view port (0: free, the default).")
    ] = 0,
    traces: Annotated[
        bool,
        typer.Option(
            help="Run the trace receiver and view, every traced part exporting its spans "
            "there (--no-traces: none; a part then exports where OTEL_EXPORTER_OTLP_ENDPOINT "
            "already says, if set)."
        ),
    ] = True,
    trace_sample: Annotated[
        float | None,
        typer.Option(
            envvar="SPILLWAY_TRACE_SAMPLE",
            min=0.0,
            max=1.0,
            help="Share of requests traced (SPILLWAY_TRACE_SAMPLE; default: every one).",
        ),
    ] = None,
    free_ports: Annotated[
        bool, typer.Option(help="Any free port for every part (beside another folder's stack).")
    ] = False,
    fresh: Annotated[
        bool,
        typer.Option(help="Start clean: the state kept by the last run moves to state.previous."),
    ] = False,
    router_runtime: Annotated[str, typer.Option(help=RUNTIME_HELP)] = "auto",
    verbose: Annotated[bool, typer.Option(help="Also show log lines in the terminal.")] = False,
) -> None:
    """The whole platform on 127.0.0.1 until Ctrl-C or SIGTERM; what it was given is kept
    across restarts."""
    from spillway_cli import preflight
    from spillway_cli.local.running import holders, running_in
    from spillway_cli.local.serverless_offline import offline_missing
    from spillway_cli.local.stackenv import stack_env_path

    ports = {
        "router": router_port,
        "gpu": gpu_port,
        "gpu_grpc": gpu_grpc_port,
        "cpu": cpu_port,
        "jobs": jobs_port,
        "moto": moto_port,
        "dashboard": dashboard_port,
        "websocket": websocket_port,
        **({"traces": traces_port} if traces else {}),
    }
    if free_ports:
        ports = dict.fromkeys(ports, 0)
    running = running_in(log_dir, stack_env_path())
    if running is not None:
        typer.echo(_already_running(running))
        raise typer.Exit(0)
    taken = {part: port for part, port in ports.items() if port and not preflight.port_free(port)}
    held = holders(taken)
    needs = offline_missing() if router_runtime == "serverless-offline" else []
    free = {part: port for part, port in ports.items() if part not in held}
    problems = [*preflight.problems(models, free, router_runtime, needs), *_held_lines(held)]
    for problem in problems:
        typer.echo(f"error: {problem}", err=True)
    if problems:
        raise typer.Exit(EXIT_CHECKS)
    tracing = Tracing(traces, trace_sample)
    _run(models, log_dir, ports, router_runtime, verbose, fresh, tracing)


def _already_running(running: StackRunning) -> str:
    """What a second ``up`` in the folder of a running stack says."""
    record = running.record
    if record is None:
        return f"A stack is already running in {running.where} (starting); nothing changed."
    lines = [
        f"A stack is already running in {running.where} (pid {record.pid}, {record.state}); "
        "nothing changed:"
    ]
    lines += [f"  {part:<9} {url}" for part, url in record.urls.items()]
    lines.append(
        f"The spillway commands reach it through {record.env_path}. Ctrl-C in its terminal "
        f"(or `kill {record.pid}`) stops it."
    )
    return "\n".join(lines)


def _held_lines(held: dict[str, StackRecord]) -> list[str]:
    """One line per other folder's stack holding ports this one wanted."""
    stacks = {record.pid: record for record in held.values()}
    lines = []
    for pid, record in stacks.items():
        parts = [part for part, holder in held.items() if holder.pid == pid]
        taken = ", ".join(f"{record.ports.get(part, '?')} ({part})" for part in parts)
        flags = " ".join(f"--{part.replace('_', '-')}-port N" for part in parts)
        lines.append(
            f"ports {taken} are taken by the Spillway stack of {record.log_dir} (pid {pid}): "
            f"stop it there, or start this one on other ports: --free-ports, or {flags} "
            "(0: any free)"
        )
    return lines


class Tracing(NamedTuple):
    """The stack's trace settings: receiver on, and the share of requests traced."""

    on: bool
    sample: float | None


def _run(
    models: Path,
    log_dir: Path,
    ports: dict[str, int],
    runtime: str,
    verbose: bool,
    fresh: bool,
    tracing: Tracing,
) -> None:
    from spillway_cli.console import report_logging
    from spillway_cli.local.layout import Ports
    from spillway_cli.local.running import StackRunning
    from spillway_cli.local.serverless_offline import runtime_choice
    from spillway_cli.local.stack import LocalStack, StackError
    from spillway_cli.local.stackenv import stack_env_path
    from spillway_cli.local.summary import runtime_line

    report_logging(log_dir / "up.log", verbose)
    chosen, why = runtime_choice(runtime)
    stack = LocalStack(
        models,
        log_dir,
        Ports(**ports),
        router_runtime=chosen,
        router_reason=why,
        router_fallback=runtime == "auto",
        progress=typer.echo,
        env_path=stack_env_path(),
        check_api_keys=True,
        findable=True,
        state_dir=log_dir / "state",
        fresh=fresh,
        traces=tracing.on,
        trace_sample=tracing.sample,
    )
    typer.echo(f"Starting Spillway (logs in {log_dir}/):")
    typer.echo(runtime_line(stack))

    def stop(signum: int, _: object) -> None:
        raise KeyboardInterrupt

    # SIGINT too: a shell that starts `up` in the background leaves SIGINT ignored
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop)
    started = time.monotonic()
    try:
        stack.start()
        typer.echo(f"Spillway is up in {time.monotonic() - started:.1f} s:\n{stack.summary()}")
        typer.echo(f"\n{runtime_line(stack)}")
        typer.echo(f"The spillway commands find this stack through {stack.stack_env_path}.")
        typer.echo(
            f"What it is given is kept in {stack.state_dir}/ when it stops "
            "(`spillway up --fresh` starts clean). Ctrl-C stops everything."
        )
        signal.pause()
    except StackRunning as exc:  # another `up` took the folder after the checks
        typer.echo(_already_running(exc))
    except StackError as exc:
        typer.echo(
            f"error: {exc.part} did not come up: {exc.reason} (log: {exc.log_path})", err=True
        )
        typer.echo("  " + exc.tail.replace("\n", "\n  "), err=True)
        raise typer.Exit(1) from None
    except (RuntimeError, TimeoutError) as exc:  # serverless-offline, the kept state
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.echo("\nStopping Spillway (Ctrl-C or SIGTERM): the parts, then moto ...")
        _stop(stack)
    finally:
        stack.stop()  # a no-op once stopped


def _stop(stack: LocalStack) -> None:
    """Stop everything (a second Ctrl-C waits: a stop cut short would leave processes
    and lose the state), then say what was kept."""
    from spillway_cli.local.keep import NOT_KEPT

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stack.stop()
    if stack.kept is not None:
        typer.echo(
            f"State kept in {stack.state_dir}/: `spillway up` here restores it, "
            f"`spillway up --fresh` starts clean. Not kept: {NOT_KEPT}."
        )
    typer.echo("Spillway stopped.")
