"""``spillway tenants`` and ``spillway config``: the live configuration every door reads.

Who each authenticated identity (an API key id or an IAM principal ARN) is, and the
functions' log level, live in one item of the routers' state table
(``spillway.tenancy.directory``); the router, the WebSocket function, the jobs function
and the CPU fallback read it at most every ``*_CONFIG_TTL_S`` seconds, so a change here
reaches every door within that time, without a deploy.

The table is found as the other commands find the stack: ``--table``, else
``ROUTER_STATE_TABLE``, else the running local stack's env file; ``--stack NAME`` reads a
deployed stack's ``RouterStateTableName`` output (boto3's own credentials and Region).
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from spillway.protocol.errors import SpillwayError
from spillway.state.table import DynamoStateStore
from spillway.tenancy.directory import ConfigWriter, LiveConfig
from spillway_cli.local.stackenv import aws_errors, require_aws, use_stack_env

tenants_app = typer.Typer(
    help="Map identities (API key ids, IAM principals) to tenants, live.", no_args_is_help=True
)
config_app = typer.Typer(help="The functions' live configuration.", no_args_is_help=True)

TableOption = Annotated[
    str | None,
    typer.Option(envvar="ROUTER_STATE_TABLE", help="The routers' state table (DynamoDB)."),
]
StackOption = Annotated[
    str | None,
    typer.Option(help="A deployed stack: its RouterStateTableName output names the table."),
]
REACH = "every door sees it within its *_CONFIG_TTL_S (30 s deployed)"


def _writer(table: str | None, stack: str | None) -> ConfigWriter:
    """The writer of the table the flags, the environment or the local stack name."""
    if stack is None and table is None:
        use_stack_env()
        import os

        table = os.environ.get("ROUTER_STATE_TABLE") or None
    require_aws()
    from spillway.aws.clients import aws_client

    if stack is not None:
        table = _stack_table(aws_client("cloudformation"), stack)
    if not table:
        typer.echo(
            "error: no state table: give --table or --stack, or start `spillway up`", err=True
        )
        raise typer.Exit(1)
    return ConfigWriter(DynamoStateStore(table, lambda: aws_client("dynamodb")))


def _stack_table(client: object, stack: str) -> str:
    """The state table a deployed stack's outputs name."""
    answer = client.describe_stacks(StackName=stack)  # type: ignore[attr-defined]
    for output in answer["Stacks"][0].get("Outputs", []):
        if output["OutputKey"] == "RouterStateTableName":
            return str(output["OutputValue"])
    typer.echo(f"error: stack {stack} has no RouterStateTableName output", err=True)
    raise typer.Exit(1)


def _fail(exc: SpillwayError) -> typer.Exit:
    typer.echo(f"error: {exc.message}", err=True)
    return typer.Exit(1)


def _show(config: LiveConfig, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps({**config.doc(), "revision": config.revision}, indent=2))
        return
    for name, value in sorted(config.settings.items()):
        typer.echo(f"setting {name}={value}")
    if not config.identities:
        typer.echo("no identities mapped: each authenticated identity is its own tenant")
    width = max((len(identity) for identity in config.identities), default=0)
    for identity, tenant in sorted(config.identities.items()):
        typer.echo(f"{identity:<{width}}  {tenant}")
    typer.echo(f"(revision {config.revision}, log level {config.log_level or 'each function'})")


@tenants_app.command("list")
def tenants_list(
    table: TableOption = None,
    stack: StackOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Every identity mapped to a tenant."""
    with aws_errors():
        try:
            _show(_writer(table, stack).read(), as_json)
        except SpillwayError as exc:
            raise _fail(exc) from None


@tenants_app.command("add")
def tenants_add(
    identity: Annotated[str, typer.Argument(help="API key id or IAM principal ARN.")],
    tenant: Annotated[str, typer.Argument(help="Its tenant (1-128 of A-Z a-z 0-9 ._:@-).")],
    table: TableOption = None,
    stack: StackOption = None,
) -> None:
    """Map IDENTITY to TENANT (replacing its tenant if it had one)."""
    with aws_errors():
        try:
            written = _writer(table, stack).add(identity, tenant)
        except SpillwayError as exc:
            raise _fail(exc) from None
    typer.echo(f"{identity} -> {tenant} (revision {written.revision}): {REACH}")


@tenants_app.command("remove")
def tenants_remove(
    identity: Annotated[str, typer.Argument(help="API key id or IAM principal ARN.")],
    table: TableOption = None,
    stack: StackOption = None,
) -> None:
    """Forget IDENTITY's tenant: it is its own tenant again."""
    with aws_errors():
        try:
            written = _writer(table, stack).remove(identity)
        except KeyError:
            typer.echo(f"error: {identity} is not mapped (`spillway tenants list`)", err=True)
            raise typer.Exit(1) from None
        except SpillwayError as exc:
            raise _fail(exc) from None
    typer.echo(f"{identity} removed (revision {written.revision}): {REACH}")


@config_app.command("show")
def config_show(
    table: TableOption = None,
    stack: StackOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """The live configuration: identities and log level."""
    tenants_list(table, stack, as_json)


def live_names() -> dict[str, tuple[str, ...]]:
    """The settings each function lets the live configuration change."""
    from spillway.router.wiring import LIVE_SETTINGS

    return {"router and WebSocket function": LIVE_SETTINGS}


@config_app.command("set")
def config_set(
    name: Annotated[str, typer.Argument(help="A live setting's variable name.")],
    value: Annotated[str, typer.Argument(help="Its value ('default': the function's own).")],
    table: TableOption = None,
    stack: StackOption = None,
) -> None:
    """Give a live setting (e.g. ROUTER_DEFAULT_DEADLINE_MS) a value over every function's
    environment; `spillway config set --help` lists them."""
    known = {n for names in live_names().values() for n in names}
    if name not in known:
        listed = "; ".join(f"{who}: {', '.join(names)}" for who, names in live_names().items())
        typer.echo(f"error: {name} cannot change live ({listed})", err=True)
        raise typer.Exit(1)
    with aws_errors():
        try:
            written = _writer(table, stack).set_setting(name, None if value == "default" else value)
        except SpillwayError as exc:
            raise _fail(exc) from None
    typer.echo(
        f"{name}={written.settings.get(name, 'default')} (revision {written.revision}): {REACH}"
    )


@config_app.command("log-level")
def config_log_level(
    level: Annotated[
        str, typer.Argument(help="DEBUG, INFO, WARNING, ERROR, CRITICAL or 'default'.")
    ],
    table: TableOption = None,
    stack: StackOption = None,
) -> None:
    """Set every function's log level ('default': each function's own LOG_LEVEL)."""
    with aws_errors():
        try:
            written = _writer(table, stack).set_log_level(None if level == "default" else level)
        except SpillwayError as exc:
            raise _fail(exc) from None
    typer.echo(f"log level {written.log_level or 'default'} (revision {written.revision}): {REACH}")
