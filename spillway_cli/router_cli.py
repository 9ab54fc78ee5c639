"""CLI for the router and the CPU fallback: policies, cost reports, local servers.

Registered by ``spillway_cli.main``: ``policy_app`` as ``spillway policy``, ``cost_app`` as
``spillway cost``, ``serve_router`` and ``serve_cpu`` as ``spillway serve router|cpu``.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer

policy_app = typer.Typer(help="Check and explain routing policies.", no_args_is_help=True)
cost_app = typer.Typer(help="Cost accounting of the router.", no_args_is_help=True)


def _fail(message: str) -> typer.Exit:
    typer.echo(message, err=True)
    return typer.Exit(1)


def _load_policy(file: Path) -> Any:
    from spillway.policy.rules import PolicyError, parse_policy

    try:
        return parse_policy(file.read_text(encoding="utf-8"), str(file))
    except OSError as exc:
        raise _fail(f"{file}: {exc.strerror or exc}") from None
    except PolicyError as exc:
        raise _fail(str(exc)) from None


@policy_app.command("check")
def policy_check(file: Annotated[Path, typer.Argument(help="Policy file (YAML or JSON).")]) -> None:
    """Validate a policy file; exit 1 with the reasons when it is not valid."""
    policy = _load_policy(file)
    names = ", ".join(rule.name for rule in policy.rules)
    typer.echo(f"{file}: valid, {len(policy.rules)} rules: {names}")


class _FixedLoad:
    """The load ``explain`` assumes: one backend busy at a level for a while."""

    def __init__(self, backend: str, busy: float | None, for_s: float) -> None:
        self.backend, self.busy, self.for_s = backend, busy, for_s

    def sustained_above(self, backend: str, threshold: float, for_s: float) -> bool:
        """Whether the assumed load is above ``threshold`` for at least ``for_s``."""
        return (
            backend == self.backend
            and self.busy is not None
            and self.busy > threshold
            and self.for_s >= for_s
        )


def _request_document(request: str) -> dict[str, Any]:
    text = Path(request[1:]).read_text(encoding="utf-8") if request.startswith("@") else request
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise _fail(f"--request is not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise _fail("--request must be a JSON object")
    return document


def _call_and_target(document: dict[str, Any], path: str) -> tuple[Any, Any]:
    from spillway.policy.facts import Call
    from spillway.protocol.wire import require_model_target

    envelope = "body" in document or "headers" in document or "path" in document
    body = document.get("body") if envelope else document
    headers = {str(k).lower(): str(v) for k, v in (document.get("headers") or {}).items()}
    target = require_model_target(str(document.get("path", path)) if envelope else path)
    raw = json.dumps(body).encode() if body is not None else b""
    return Call(method=target.method, headers=headers, body=raw, request_id="explain"), target


@policy_app.command("explain")
def policy_explain(
    file: Annotated[Path, typer.Argument(help="Policy file (YAML or JSON).")],
    request: Annotated[
        str,
        typer.Option(
            help="JSON (or @file): an infer body, or {path, headers, body} around one.",
        ),
    ],
    path: Annotated[str, typer.Option(help="Path when --request is a bare body.")] = (
        "/v2/models/digits/infer"
    ),
    at: Annotated[str | None, typer.Option(help="ISO time to decide at (default now).")] = None,
    gpu_busy: Annotated[float | None, typer.Option(help="Assume this GPU busy fraction.")] = None,
    busy_for: Annotated[float, typer.Option(help="…sustained for this many seconds.")] = 0.0,
) -> None:
    """Print the decision for a request and why each rule before it did not fire."""
    from spillway.policy.decision import explain, with_allowed_priority
    from spillway.policy.facts import read_request
    from spillway.protocol.errors import SpillwayError

    policy = _load_policy(file)
    try:
        when = datetime.fromisoformat(at) if at else datetime.now(UTC)
        when = when if when.tzinfo else when.replace(tzinfo=UTC)
        call, target = _call_and_target(_request_document(request), path)
        # Offline, the request document says who the caller is: its tenant hint counts.
        facts = read_request(call, target, trust_tenant_hints=True).facts
        facts = with_allowed_priority(policy, facts)
    except (ValueError, SpillwayError) as exc:
        raise _fail(f"cannot explain: {getattr(exc, 'message', exc)}") from None
    traces = explain(policy, facts, when, _FixedLoad("gpu", gpu_busy, busy_for))
    for trace in traces:
        mark = "FIRES " if trace.matched else "skip  "
        typer.echo(f"{mark}{trace.rule}: {trace.reason}")
    rule = next(r for r in policy.rules if r.name == traces[-1].rule)
    typer.echo(
        f"decision: rule {rule.name}, backends {' -> '.join(policy.chain(rule, rule.route))}"
    )
    if rule.spill is not None:
        spilled = " -> ".join(policy.chain(rule, rule.spill.to))
        typer.echo(f"spill: {rule.spill.share:.0%} of these requests go {spilled}")


@cost_app.command("report")
def cost_report(
    log: Annotated[
        Path | None,
        typer.Argument(
            help="Metrics log: EMF JSON lines ('-': stdin). Default: the running stack's "
            "(SPILLWAY_METRICS_LOG)."
        ),
    ] = None,
    output: Annotated[str, typer.Option("--format", help="markdown or json.")] = "markdown",
) -> None:
    """Summarise the router's per-request metrics by route (rule and backend)."""
    from spillway_cli.cost_report import as_json, markdown, summarise
    from spillway_cli.local.stackenv import use_stack_env

    if output not in ("markdown", "json"):
        raise _fail("--format must be markdown or json")
    if log is None:
        use_stack_env()
        stack_log = os.environ.get("SPILLWAY_METRICS_LOG")
        if not stack_log:
            raise _fail("no metrics log: give LOG (or start a local stack with `spillway up`)")
        log = Path(stack_log)
    try:
        if str(log) == "-":
            routes = summarise(sys.stdin)
        else:
            with log.open(encoding="utf-8") as handle:
                routes = summarise(handle)
    except OSError as exc:
        raise _fail(f"{log}: {exc.strerror or exc}") from None
    if output == "json":
        typer.echo(json.dumps(as_json(routes), indent=2))
    else:
        typer.echo(markdown(routes))


def serve_router(
    host: Annotated[str | None, typer.Option(help="Address to listen on.")] = None,
    port: Annotated[int | None, typer.Option(help="Port to listen on.")] = None,
    policy: Annotated[Path | None, typer.Option(help="Policy file (YAML or JSON).")] = None,
    gpu_url: Annotated[str | None, typer.Option(help="GPU service base URL.")] = None,
    cpu_url: Annotated[str | None, typer.Option(help="CPU fallback base URL.")] = None,
    api_key: Annotated[
        list[str] | None,
        typer.Option(
            "--api-key",
            help="As API Gateway's usage plan: 403 unless x-api-key is one of these "
            "(repeatable; the key is its own id for the tenant map). Each request then "
            "reaches the router as API Gateway's event (a body base64-encoded).",
        ),
    ] = None,
    invoke: Annotated[
        str | None,
        typer.Option(
            help="Run no router here: hand each request's API Gateway event to the "
            "function at this Lambda invoke endpoint (serverless-offline's --lambdaPort).",
        ),
    ] = None,
    function: Annotated[
        str | None, typer.Option(help="The function --invoke invokes (default: the router's).")
    ] = None,
) -> None:
    """The router on a local HTTP server; ROUTER_* variables apply, flags win. With
    --api-key, the REST API's door in front (``spillway_cli.local.lambda_http``)."""
    from aws_lambda_powertools.logging import Logger

    from spillway import tracing
    from spillway.policy.rules import PolicyError
    from spillway.router.settings import RouterSettings
    from spillway.router.wiring import create_app
    from spillway_cli.local import lambda_http
    from spillway_cli.local.names import ROUTER_FUNCTION
    from spillway_cli.local.wsgi_server import serve_forever

    if invoke is not None:
        if not api_key:
            raise _fail("--invoke needs --api-key (the REST API's door)")
        name = function or ROUTER_FUNCTION
        door = lambda_http.rest_app(lambda_http.invoke_handler(invoke, name), name)
        served = lambda_http.api_key_door(door, api_key)
        serve_forever(served, host or "127.0.0.1", port if port is not None else 8080)
        return
    try:
        settings = RouterSettings.from_env(
            host=host, port=port, policy_file=policy, gpu_url=gpu_url, cpu_url=cpu_url
        )
        Logger(service="spillway.router", level=settings.log_level)
        tracing.configure("spillway-router")  # as the Lambda handler does: OTEL_* decide
        app = create_app(settings)
    except (ValueError, PolicyError) as exc:
        raise _fail(f"cannot start the router: {exc}") from None
    if api_key:
        # The router function's path as deployed: API Gateway's event, the body
        # base64-encoded (binaryMediaTypes */*), decoded by serverless-wsgi.
        handler = lambda_http.wsgi_handler(app, ROUTER_FUNCTION)
        served = lambda_http.api_key_door(lambda_http.rest_app(handler), api_key)
        serve_forever(served, settings.host, settings.port)
    else:
        serve_forever(app, settings.host, settings.port)


def serve_cpu(
    host: Annotated[str | None, typer.Option(help="Address to listen on.")] = None,
    port: Annotated[int | None, typer.Option(help="Port to listen on.")] = None,
    repository: Annotated[str | None, typer.Option(help="Folder or s3://bucket/prefix.")] = None,
) -> None:
    """The CPU fallback on a local HTTP server (also Lambda's invoke API); CPU_* apply."""
    from aws_lambda_powertools.logging import Logger

    from spillway import tracing
    from spillway.fallback.app import CpuApp
    from spillway.fallback.async_drain import start_local_drain
    from spillway.fallback.service import CpuService
    from spillway.fallback.settings import CpuSettings
    from spillway_cli.local.wsgi_server import serve_forever

    flags = {"host": host, "port": port, "repository": repository}
    settings = CpuSettings.model_validate({k: v for k, v in flags.items() if v is not None})
    Logger(service="spillway.cpu_infer", level=settings.log_level)
    tracing.configure("spillway-cpu")  # before the drain's worker names the process
    service = CpuService.load(settings)
    start_local_drain(service)  # the async queue's second consumer, when ASYNC_* is set
    serve_forever(CpuApp(service), settings.host, settings.port)
