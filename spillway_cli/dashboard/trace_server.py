"""The local trace receiver and view that ``spillway up`` runs: a WSGI app on 127.0.0.1.

``POST /v1/traces`` is an OTLP/HTTP trace receiver (``otlp`` decodes; every process of
the stack exports there). ``GET /api/traces`` lists recent traces (filters ``service``,
``name``, ``min_ms``, ``tenant``, ``limit``), ``GET /api/traces/{trace_id}`` gives every
span of one, and ``/traces`` and ``/traces/{trace_id}`` are the pages over them (a list,
and a waterfall of one trace: spans nested by parent, bars by time, links followed).

Run as ``python -m spillway_cli.dashboard.trace_server --port N`` (``spillway up`` does).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qs

from spillway.protocol.errors import (
    InvalidInputError,
    MethodNotAllowedError,
    PayloadTooLargeError,
    RouteNotFoundError,
    SpillwayError,
)
from spillway_cli.dashboard import otlp
from spillway_cli.dashboard.server import STATIC, StartResponse, answer
from spillway_cli.dashboard.traces import MAX_LIMIT, TraceQuery, TraceStore

log = logging.getLogger("spillway.traces")
_TRACE_ID = re.compile(r"^[0-9a-fA-F]{32}$")
_PAGE = "traces.html"
_FILES = ("traces.html", "traces.js", "traces.css")
_MAX_FILTER = 200
"""The longest text filter (``service``, ``name``, ``tenant``) taken."""


class TraceApp:
    """WSGI: the OTLP receiver, the query API and the pages over one ``TraceStore``."""

    def __init__(self, store: TraceStore, max_body_bytes: int = otlp.MAX_BODY_BYTES) -> None:
        self.store = store
        self.max_body_bytes = max_body_bytes
        self.files = {f"/static/{name}": STATIC / name for name in _FILES}

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        method = environ.get("REQUEST_METHOD", "GET")
        if path == "/v1/traces":
            return self._receive(environ, start_response, method)
        try:
            if method not in ("GET", "HEAD"):
                raise MethodNotAllowedError(f"{method} {path}: only GET here")
            return self._read(environ, start_response, path)
        except SpillwayError as exc:
            body = json.dumps(exc.to_body()).encode()
            return answer(start_response, exc.status, "application/json", body)

    def _read(
        self, environ: dict[str, Any], start_response: StartResponse, path: str
    ) -> list[bytes]:
        """The query API, the pages and their files."""
        if path == "/api/traces":
            found = self.store.summaries(query_of(environ.get("QUERY_STRING", "")))
            return _json(start_response, {"traces": found})
        if path.startswith("/api/traces/"):
            trace_id = path.removeprefix("/api/traces/")
            if not _TRACE_ID.match(trace_id):
                raise InvalidInputError(f"{trace_id[:40]!r} is not a trace id (32 hex digits)")
            trace = self.store.trace(trace_id)
            if trace is None:
                raise RouteNotFoundError(f"no trace {trace_id} received (yet)")
            return _json(start_response, trace)
        if path == "/api/health":
            traces, spans = self.store.counts()
            return _json(start_response, {"live": True, "traces": traces, "spans": spans})
        if path in ("/", "/traces", "/traces/") or path.startswith("/traces/"):
            page = (STATIC / _PAGE).read_bytes()
            return answer(start_response, 200, "text/html", page)
        file = self.files.get(path)
        if file is None:
            raise RouteNotFoundError(f"{path[:100]} is not a page or API of the trace view")
        kind = "text/css" if file.suffix == ".css" else "text/javascript"
        return answer(start_response, 200, kind, file.read_bytes())

    def _receive(
        self, environ: dict[str, Any], start_response: StartResponse, method: str
    ) -> list[bytes]:
        """``POST /v1/traces``: decode, keep, answer in the request's encoding."""
        kind = otlp.media_type(environ.get("CONTENT_TYPE"))
        try:
            if method != "POST":
                raise MethodNotAllowedError("POST an OTLP trace export to /v1/traces")
            kind = otlp.check_headers(kind, environ.get("HTTP_CONTENT_ENCODING"))
            body = self._body(environ)
            encoding = environ.get("HTTP_CONTENT_ENCODING")
            export = otlp.decode(body, kind, encoding, self.max_body_bytes)
        except SpillwayError as exc:
            return answer(start_response, exc.status, _answer_kind(kind), otlp.failure(kind, exc))
        self.store.add(export.spans)
        return answer(start_response, 200, kind, otlp.success(kind, export))

    def _body(self, environ: dict[str, Any]) -> bytes:
        """The request body, refused before it is read when it says it is too large, and
        while it is read when it turns out to be."""
        length = environ.get("CONTENT_LENGTH") or ""
        stream = environ["wsgi.input"]
        if length:
            if not length.isdigit():
                raise InvalidInputError(f"Content-Length {length[:20]!r} is not a number")
            if int(length) > self.max_body_bytes:
                raise PayloadTooLargeError(
                    f"the body is {length} bytes; at most {self.max_body_bytes} are taken"
                )
            return bytes(stream.read(int(length)))
        if not environ.get("wsgi.input_terminated"):
            return b""  # neither a length nor chunked: an empty body
        body = bytes(stream.read(self.max_body_bytes + 1))
        if len(body) > self.max_body_bytes:
            raise PayloadTooLargeError(f"the body is over {self.max_body_bytes} bytes")
        return body


def query_of(text: str) -> TraceQuery:
    """The ``/api/traces`` filters from a query string, each checked."""
    params = {key: values[-1] for key, values in parse_qs(text).items()}
    for key in ("service", "name", "tenant"):
        if len(params.get(key, "")) > _MAX_FILTER:
            raise InvalidInputError(f"{key} is longer than {_MAX_FILTER} characters")
    try:
        limit = int(params.get("limit", "50"))
        min_ms = float(params.get("min_ms", "0"))
    except ValueError:
        raise InvalidInputError("limit must be an integer and min_ms a number") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidInputError(f"limit must be between 1 and {MAX_LIMIT}, not {limit}")
    if not (math.isfinite(min_ms) and min_ms >= 0):
        raise InvalidInputError(f"min_ms must be a number of milliseconds >= 0, not {min_ms}")
    return TraceQuery(
        service=params.get("service") or None,
        name=params.get("name") or None,
        min_ms=min_ms,
        tenant=params.get("tenant") or None,
        limit=limit,
    )


def _answer_kind(kind: str) -> str:
    """The content type of a refusal: the request's when the receiver takes it."""
    return otlp.PROTOBUF if kind == otlp.PROTOBUF else otlp.JSON


def _json(start_response: StartResponse, document: dict[str, Any]) -> list[bytes]:
    body = json.dumps(document, separators=(",", ":")).encode()
    return answer(start_response, 200, "application/json", body)


def guarded(app: TraceApp) -> Callable[[dict[str, Any], StartResponse], Iterable[bytes]]:
    """``app`` behind the last-resort handler: an unexpected error is logged with its
    traceback and answered with a generic 500."""

    def serve(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        try:
            return app(environ, start_response)
        except Exception:  # the last resort: logged with its traceback
            log.exception("the trace view failed on %s", environ.get("PATH_INFO"))
            body = json.dumps(SpillwayError("internal error").to_body()).encode()
            return answer(start_response, 500, "application/json", body)

    return serve


def main(argv: list[str] | None = None) -> None:
    """Serve the receiver and the view until SIGINT or SIGTERM."""
    from spillway_cli.local.wsgi_server import serve_forever

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4318)
    parser.add_argument("--max-traces", type=int, default=2000)
    parser.add_argument("--max-spans", type=int, default=200_000)
    parser.add_argument("--max-spans-per-trace", type=int, default=2000)
    parser.add_argument("--max-body-bytes", type=int, default=otlp.MAX_BODY_BYTES)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    store = TraceStore(args.max_traces, args.max_spans, args.max_spans_per_trace)
    serve_forever(guarded(TraceApp(store, args.max_body_bytes)), args.host, args.port)


if __name__ == "__main__":
    main()
