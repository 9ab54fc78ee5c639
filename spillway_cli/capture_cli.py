"""``spillway capture``: read a tenant's captured requests back, and replay them.

``spillway capture list`` (or the bare ``spillway capture``) lists the records of one
tenant (``--tenant``; none: the anonymous tenant) under the capture root
(``--root``, else ``ROUTER_CAPTURE_ROOT``), filtered by model, time range and status, as
a table or JSON lines. ``spillway capture replay --to URL`` sends the kept requests to a
router or GPU service (``--version``: to that version of the model) and compares the
answers with the captured ones: exit 0 when every compared record matched, 1 when one
differed or got no answer, 2 when none could be compared.

S3 is reached as every command reaches AWS: boto3's variables (``AWS_ENDPOINT_URL`` for a
moto server), else the running ``spillway up`` stack's env file
(``spillway_cli.local.stackenv``). docs/capture.md has the record's schema.

Registered by ``spillway_cli.main`` as the ``capture`` group.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated

import typer

from spillway.protocol.errors import SpillwayError
from spillway.tenancy.identity import tenant_hint
from spillway_cli.local.stackenv import aws_errors, require_aws, use_stack_env

if TYPE_CHECKING:
    from spillway.capture.reader import CaptureReader, Query
    from spillway.capture.records import CaptureRecord
    from spillway.capture.replay import Answer, Report

capture_app = typer.Typer(
    help="Read back and replay the requests data capture kept (docs/capture.md).",
    invoke_without_command=True,
)

TenantOption = Annotated[
    str | None,
    typer.Option(help="Read this tenant's records (default: the anonymous tenant's)."),
]
RootOption = Annotated[
    str | None,
    typer.Option(envvar="ROUTER_CAPTURE_ROOT", help="The capture root, s3://bucket/prefix."),
]
ModelOption = Annotated[
    list[str] | None, typer.Option("--model", help="Only this model (repeatable).")
]
SinceOption = Annotated[
    str | None,
    typer.Option(help="From this time: ISO 8601 (UTC unless it says) or an age (15m, 2h, 7d)."),
]
UntilOption = Annotated[str | None, typer.Option(help="Up to this time (same forms).")]
StatusOption = Annotated[
    list[str] | None,
    typer.Option("--status", help="Only this status: 200, a class (4xx, 5xx), error or ok."),
]
LimitOption = Annotated[int | None, typer.Option(min=1, help="Only the most recent N records.")]


@capture_app.callback()
def capture_main(ctx: typer.Context) -> None:
    """Read back and replay captured requests; alone, lists the anonymous tenant's."""
    if ctx.invoked_subcommand is None:
        ctx.invoke(list_records)


@capture_app.command("list")
def list_records(
    tenant: TenantOption = None,
    root: RootOption = None,
    model: ModelOption = None,
    since: SinceOption = None,
    until: UntilOption = None,
    status: StatusOption = None,
    limit: LimitOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Whole records as JSON lines.")] = False,
) -> None:
    """One tenant's captured records, oldest first: a table, or JSON lines."""
    reader, query = _reader_and_query(tenant, root, model, since, until, status, limit)
    records = _read(reader, query)
    if as_json:
        for record in records:
            typer.echo(record.line().decode("utf-8", "surrogatepass").rstrip("\n"))
        return
    typer.echo(f"{reader.location} ({_who(tenant)}): {len(records)} records", err=True)
    typer.echo(table(records))


@capture_app.command("replay")
def replay_records(
    to: Annotated[str, typer.Option(help="Router or GPU service base URL to send to.")],
    version: Annotated[str | None, typer.Option(help="Send to this version of each model.")] = None,
    tenant: TenantOption = None,
    root: RootOption = None,
    model: ModelOption = None,
    since: SinceOption = None,
    until: UntilOption = None,
    status: StatusOption = None,
    limit: LimitOption = None,
    rtol: Annotated[float, typer.Option(min=0, help="Relative tolerance of floats.")] = 1e-5,
    atol: Annotated[float, typer.Option(min=0, help="Absolute tolerance of floats.")] = 1e-6,
    header: Annotated[
        list[str] | None,
        typer.Option("--header", help="'Name: value' sent with each request (repeatable)."),
    ] = None,
    timeout: Annotated[float, typer.Option(min=0.1, help="Seconds to wait per request.")] = 30.0,
    show: Annotated[int, typer.Option(min=0, help="Differences listed at most.")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="The report as JSON.")] = False,
) -> None:
    """Send the kept requests again and compare the answers with the captured ones:
    matched, differed, not replayable, failed. Exit 1 when one differed or failed, 2
    when none could be compared."""
    from spillway.capture.replay import Tolerance, replay

    base = _base_url(to)
    extra = _headers(header or [])
    reader, query = _reader_and_query(tenant, root, model, since, until, status, limit)
    records = _read(reader, query)
    try:
        report = replay(
            records,
            lambda path, headers, body: post(base + path, {**headers, **extra}, body, timeout),
            version=version,
            tolerance=Tolerance(rtol=rtol, atol=atol),
        )
    except SpillwayError as exc:
        raise _fail(exc.message) from None
    if as_json:
        typer.echo(json.dumps(report_document(report), indent=2))
    else:
        typer.echo(describe_report(report, show))
    counts = report.counts
    if counts["differed"] or counts["failed"]:
        raise typer.Exit(1)
    if report.compared == 0:
        typer.echo("no record could be compared: nothing to judge", err=True)
        raise typer.Exit(2)


def post(url: str, headers: Mapping[str, str], body: bytes, timeout_s: float) -> Answer:
    """POST ``body`` to ``url``; the answer whatever its status (``SendFailed`` when
    nothing answers)."""
    from spillway.capture.replay import Answer, SendFailed

    request = urllib.request.Request(url, data=body, headers=dict(headers), method="POST")  # noqa: S310 - http(s) checked by _base_url
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310
            return Answer(response.status, _lower(response.headers.items()), response.read())
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, _lower(exc.headers.items()), exc.read())
    except (urllib.error.URLError, OSError) as exc:
        raise SendFailed(f"{url}: {getattr(exc, 'reason', exc)}") from None


def _lower(items: Iterable[tuple[str, str]]) -> dict[str, str]:
    return {str(k).lower(): str(v) for k, v in items}


def table(records: list[CaptureRecord]) -> str:
    """The records as ``spillway capture list`` prints them."""
    head = ("TIME (UTC)", "MODEL", "VER", "STATUS", "BACKEND", "MS", "RULE", "REQUEST", "NOTE")
    rows = [head]
    for r in records:
        notes = [r.error.code] if r.error is not None else []
        if r.truncated:
            notes.append("truncated")
        elif not r.replayable:
            notes.append(f"keep {r.keep}")
        rows.append(
            (
                r.time.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S"),
                r.model,
                r.version or "-",
                str(r.status),
                r.backend or "-",
                f"{r.latency_ms:.1f}",
                r.rule or "-",
                r.request_id[:16],
                ", ".join(notes),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def describe_report(report: Report, show: int) -> str:
    """The replay's counts, then each difference and failure (``show`` at most)."""
    lines = [report.summary()]
    shown = [r for r in report.results if r.verdict in ("differed", "failed")]
    for result in shown[:show]:
        r = result.record
        lines.append(
            f"  {result.verdict}: {r.model} {r.time.astimezone(UTC):%Y-%m-%d %H:%M:%S} "
            f"request {r.request_id[:16]} ({r.id[:8]}): {result.reason}"
        )
    if len(shown) > show:
        lines.append(f"  … and {len(shown) - show} more")
    reasons: dict[str, int] = {}
    for result in report.results:
        if result.verdict == "not_replayable":
            reasons[result.reason] = reasons.get(result.reason, 0) + 1
    lines += [f"  not replayable ({n}): {reason}" for reason, n in sorted(reasons.items())]
    return "\n".join(lines)


def report_document(report: Report) -> dict[str, object]:
    """The replay as JSON: counts and one entry per record."""
    return {
        "counts": report.counts,
        "results": [
            {
                "id": r.record.id,
                "request_id": r.record.request_id,
                "model": r.record.model,
                "time": r.record.time.isoformat(),
                "captured_status": r.record.status,
                "status": r.status,
                "verdict": r.verdict,
                "reason": r.reason,
            }
            for r in report.results
        ],
    }


def _reader_and_query(
    tenant: str | None,
    root: str | None,
    model: list[str] | None,
    since: str | None,
    until: str | None,
    status: list[str] | None,
    limit: int | None,
) -> tuple[CaptureReader, Query]:
    from spillway.aws.clients import client
    from spillway.capture.layout import Area
    from spillway.capture.reader import CaptureReader, Query, StatusFilter, parse_when
    from spillway.protocol.names import validate_model_name

    use_stack_env()
    where = root or os.environ.get("ROUTER_CAPTURE_ROOT")
    if not where:
        raise _fail(
            "no capture root: pass --root or set ROUTER_CAPTURE_ROOT (the router's setting)"
        )
    now = datetime.now(UTC)
    try:
        who = tenant_hint(tenant)
        query = Query(
            models=tuple(validate_model_name(m) for m in model or []),
            since=parse_when(since, now) if since else None,
            until=parse_when(until, now) if until else None,
            status=StatusFilter(tuple(status or [])),
            limit=limit,
        )
        Area.of(where, who)  # a root that is no s3://bucket/prefix fails here, plainly
    except SpillwayError as exc:
        raise _fail(exc.message) from None
    require_aws()
    return CaptureReader(client("s3", max_attempts=3), where, who), query


def _read(reader: CaptureReader, query: Query) -> list[CaptureRecord]:
    from spillway.aws.errors import aws_errors as sdk_errors

    try:
        with aws_errors():
            records = reader.records(query)
    except SpillwayError as exc:
        raise _fail(exc.message) from None
    except sdk_errors() as exc:
        raise _fail(f"cannot read {reader.location}: {str(exc)[:300]}") from None
    if reader.unreadable:
        typer.echo(f"warning: {reader.unreadable} lines or objects held no record", err=True)
    return records


def _who(tenant: str | None) -> str:
    return f"tenant {tenant}" if tenant else "the anonymous tenant"


def _base_url(value: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _fail(f"--to {value!r} is not an http(s) URL")
    return value.rstrip("/")


def _headers(values: list[str]) -> dict[str, str]:
    found: dict[str, str] = {}
    for value in values:
        name, sep, text = value.partition(":")
        if not sep or not name.strip():
            raise _fail(f"--header {value[:60]!r} is not 'Name: value'")
        found[name.strip().lower()] = text.strip()
    return found


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(1)
