"""``spillway models canary`` and ``spillway models status``: a model's canary in the
router's shared state table (``ROUTER_STATE_TABLE``), the record every router reads.

Both find the state table, the backends and the model repository of a stack started by
``spillway up`` through its stack env file (``spillway_cli.local.stackenv``) when no flag or
variable names them.

``models canary`` asks the router's backends (``--gpu-url``, ``--cpu-url`` or
``--cpu-function``, defaulting to the router's own ``ROUTER_*`` variables) whether they
serve the canary version and prints what each said; ``--promote`` refuses a version that
one of them answers it does not serve (after promotion every unpinned request would get
it). A backend that cannot be asked is reported, not counted as a refusal.

Registered by ``spillway_cli.main`` on the ``models`` group.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated

import typer

from spillway.canary.records import CanaryState, CanaryStore
from spillway.models.canary_spec import RollbackBounds
from spillway.protocol.errors import SpillwayError
from spillway_cli.local.stackenv import aws_errors, require_aws, use_stack_env

if TYPE_CHECKING:
    from spillway.policy.backend import Backend

TableOption = Annotated[
    str | None,
    typer.Option(envvar="ROUTER_STATE_TABLE", help="The routers' state table (DynamoDB)."),
]
RepositoryOption = Annotated[
    str | None,
    typer.Option(
        envvar="SPILLWAY_REPOSITORY",
        help="Folder or s3://… repository: the newest version when --percent comes "
        "without --version and no canary runs.",
    ),
]


GpuUrlOption = Annotated[
    str | None,
    typer.Option(envvar="ROUTER_GPU_URL", help="The GPU service the routers send to."),
]
CpuUrlOption = Annotated[
    str | None,
    typer.Option(envvar="ROUTER_CPU_URL", help="The CPU fallback over HTTP (local stacks)."),
]
CpuFunctionOption = Annotated[
    str | None,
    typer.Option(envvar="ROUTER_CPU_FUNCTION", help="The CPU fallback function (lambda:Invoke)."),
]
PROBE_TIMEOUT_S = 10.0


def version_backends(
    gpu_url: str | None, cpu_url: str | None, cpu_function: str | None
) -> dict[str, Backend]:
    """The backends a router with these settings sends to."""
    from spillway.router.backends import HttpBackend
    from spillway.router.lambda_backend import LambdaBackend

    backends: dict[str, Backend] = {}
    if gpu_url:
        backends["gpu"] = HttpBackend("gpu", gpu_url, pool_size=1)
    if cpu_function:
        backends["cpu"] = LambdaBackend("cpu", cpu_function, read_timeout_s=PROBE_TIMEOUT_S)
    elif cpu_url:
        backends["cpu"] = HttpBackend("cpu", cpu_url, pool_size=1)
    return backends


def serving(backends: dict[str, Backend], model: str, version: int) -> dict[str, bool | None]:
    """What each backend says about serving ``version`` (``None``: it could not tell)."""
    from spillway.canary.selection import version_served

    return {
        name: version_served(backend, model, version, PROBE_TIMEOUT_S)
        for name, backend in backends.items()
    }


def describe_serving(version: int, answers: dict[str, bool | None]) -> str:
    """One line: which backends serve ``version``."""
    if not answers:
        return f"  v{version} served by: not checked (no --gpu-url, --cpu-url or --cpu-function)"
    words = {True: "serves it", False: "does not serve it", None: "could not be asked"}
    parts = ", ".join(f"{name} {words[answer]}" for name, answer in answers.items())
    return f"  v{version}: {parts}"


def _store(table: str) -> CanaryStore:
    import time

    from spillway.aws.clients import aws_client
    from spillway.state.table import DynamoStateStore

    return CanaryStore(DynamoStateStore(table, lambda: aws_client("dynamodb")), time.time)


def _run(action: Callable[[], CanaryState | None]) -> CanaryState | None:
    try:
        with aws_errors():
            return action()
    except SpillwayError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(1) from None


def _table(table: str | None) -> str:
    """The state table: the flag, ``ROUTER_STATE_TABLE``, or the running stack's."""
    use_stack_env()
    found = table or os.environ.get("ROUTER_STATE_TABLE")
    if not found:
        raise _fail(
            "no state table: pass --table or set ROUTER_STATE_TABLE "
            "(or start a local stack with `spillway up`)"
        )
    require_aws()
    return found


def canary_version(store: CanaryStore, model: str, repository: str | None) -> int:
    """The version ``--percent`` without ``--version`` means: the canary in force (running
    or rolled back), else the newest version in the repository."""
    current = _run(lambda: store.load(model))
    if current is not None and current.canary is not None:
        return current.canary
    if not repository:
        raise _fail(f"{model} has no canary: pass --version (or --repository for the newest)")
    from spillway.models.repository import open_repository

    try:
        with aws_errors():
            versions = open_repository(repository).list_versions(model)
    except SpillwayError as exc:
        raise _fail(exc.message) from None
    if not versions:
        raise _fail(f"{model} has no versions in {repository}: pass --version")
    return max(versions)


def models_canary(
    model: Annotated[str, typer.Option(help="Model name.")],
    table: TableOption = None,
    version: Annotated[int | None, typer.Option(help="The canary version.")] = None,
    percent: Annotated[
        float | None, typer.Option(help="Share of unpinned requests for the canary, 0-100.")
    ] = None,
    stable: Annotated[
        int | None, typer.Option(help="The stable version (a model's first canary only).")
    ] = None,
    promote: Annotated[
        bool, typer.Option("--promote", help="Make the running canary the stable version.")
    ] = False,
    max_error_increase: Annotated[
        float | None, typer.Option(help="Rollback bound: fault rate above stable (0.01 = +1 pt).")
    ] = None,
    max_p99_ratio: Annotated[
        float | None, typer.Option(help="Rollback bound: p99 over stable's, as a factor.")
    ] = None,
    min_requests: Annotated[
        int | None, typer.Option(help="Requests per version in the window before judging.")
    ] = None,
    window_s: Annotated[float | None, typer.Option(help="The sliding window in seconds.")] = None,
    allow_pinned: Annotated[
        bool | None,
        typer.Option(
            "--allow-pinned/--refuse-pinned",
            help="Whether a request that pins a rolled-back version is still served by it "
            "(refused with 409 version_rolled_back unless allowed).",
        ),
    ] = None,
    gpu_url: GpuUrlOption = None,
    cpu_url: CpuUrlOption = None,
    cpu_function: CpuFunctionOption = None,
    repository: RepositoryOption = None,
) -> None:
    """Start a canary or change its share (--version V --percent P; without --version, the
    canary in force or else the newest version), or --promote it; --allow-pinned /
    --refuse-pinned decide whether pinned requests reach rolled-back versions (alone, or
    with either). Says which backends serve the canary version, and refuses to promote one
    that a backend does not serve."""
    store = _store(_table(table))
    backends = version_backends(
        gpu_url or os.environ.get("ROUTER_GPU_URL"),
        cpu_url or os.environ.get("ROUTER_CPU_URL"),
        cpu_function or os.environ.get("ROUTER_CPU_FUNCTION"),
    )
    if promote:
        current = _run(lambda: store.load(model))
        if version is not None and current is not None and current.canary != version:
            raise _fail(f"the running canary of {model} is v{current.canary}, not v{version}")
        served: dict[str, bool | None] = {}
        if current is not None and current.canary is not None:
            served = serving(backends, model, current.canary)
            typer.echo(describe_serving(current.canary, served))
            refusing = [name for name, answer in served.items() if answer is False]
            if refusing:
                raise _fail(
                    f"v{current.canary} of {model} is not served by {', '.join(refusing)}: "
                    "promoted, it would get every unpinned request there; publish it where "
                    "that backend reads its repository (and a version_policy that serves it) "
                    "first"
                )
        state = _run(lambda: store.promote(model))
        typer.echo(describe(_pinning(store, model, allow_pinned) or state, model))
        return
    if version is None and percent is None and allow_pinned is not None:
        typer.echo(describe(_pinning(store, model, allow_pinned), model))
        return
    if percent is None:
        raise _fail("--percent is required (or --promote, or --allow-pinned)")
    if version is None:
        version = canary_version(store, model, repository or os.environ.get("SPILLWAY_REPOSITORY"))
    changes = {
        "max_error_rate_increase": max_error_increase,
        "max_p99_ratio": max_p99_ratio,
        "min_requests": min_requests,
        "window_s": window_s,
    }
    bounds = None
    if any(v is not None for v in changes.values()):
        current = _run(lambda: store.load(model))
        base = current.bounds if current is not None else RollbackBounds()
        given = {k: v for k, v in changes.items() if v is not None}
        try:
            bounds = RollbackBounds.model_validate({**base.model_dump(), **given})
        except ValueError as exc:
            raise _fail(f"invalid rollback bounds: {exc}") from None
    chosen = version
    state = _run(lambda: store.start(model, chosen, percent, stable=stable, bounds=bounds))
    typer.echo(describe(_pinning(store, model, allow_pinned) or state, model))
    typer.echo(describe_serving(chosen, serving(backends, model, chosen)))


def _pinning(store: CanaryStore, model: str, allow: bool | None) -> CanaryState | None:
    """The record after setting ``allow_pinned`` (``None``: left as it is)."""
    if allow is None:
        return None
    return _run(lambda: store.set_allow_pinned(model, allow))


def models_status(
    model: Annotated[str, typer.Argument(help="Model name.")],
    table: TableOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="The record as JSON.")] = False,
) -> None:
    """A model's canary: stable and canary versions, share, rollback bounds, history."""
    store = _store(_table(table))
    state = _run(lambda: store.load(model))
    if as_json:
        typer.echo(json.dumps(state.model_dump(mode="json") if state else None, indent=2))
    else:
        typer.echo(describe(state, model))


def describe(state: CanaryState | None, model: str) -> str:
    """The record as ``spillway models status`` prints it."""
    if state is None:
        return f"{model}: no canary record (requests get the backends' default version)"
    if state.canary is None:
        head = f"{model}: stable v{state.stable}, no canary"
    else:
        head = (
            f"{model}: stable v{state.stable}, canary v{state.canary} at "
            f"{state.percent:g}% ({state.status.replace('_', ' ')})"
        )
    b = state.bounds
    lines = [
        head,
        f"  rollback when, over {b.window_s:g} s and at least {b.min_requests} requests per "
        f"version: fault rate > stable + {b.max_error_rate_increase * 100:g} points, or p99 > "
        f"stable x {b.max_p99_ratio:g} (and + {b.min_p99_increase_ms:g} ms)",
    ]
    if state.rolled_back:
        versions = ", ".join(f"v{v}" for v in state.rolled_back)
        served = "served" if state.allow_pinned else "refused (409 version_rolled_back)"
        lines.append(f"  rolled back: {versions}; requests that pin them are {served}")
    if state.history:
        lines.append("  history:")
    for event in state.history:
        when = datetime.fromtimestamp(event.at, UTC).strftime("%Y-%m-%d %H:%M:%S")
        reason = f"  {event.reason}" if event.reason else ""
        lines.append(
            f"    {when}Z  {event.event:<11}  v{event.version} over v{event.stable}  "
            f"{event.percent:g}%{reason}"
        )
    return "\n".join(lines)


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(1)
