"""The WSGI entry, written once for every WSGI service (the router, the CPU fallback).

A request's method and path are read (an HTTP API stage name at the front of the path
removed), the service's ``route`` answers it through ``replies.guarded`` (so every error is
mapped and logged alike), and the reply is written with its length and the status phrase
every transport writes (``replies.status_phrase``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from spillway.protocol.replies import Headers, Reply, guarded, status_phrase
from spillway.protocol.wire import strip_stage

StartResponse = Callable[[str, list[tuple[str, str]]], Any]
Route = Callable[[str, str], Reply]
"""A service's answer to a method and a path (raising ``SpillwayError`` to refuse it)."""


def serve(
    environ: Mapping[str, Any],
    start_response: StartResponse,
    log: logging.Logger,
    route: Route,
    *,
    where: Mapping[str, object] | None = None,
    headers: Headers | None = None,
) -> list[bytes]:
    """Answer one WSGI request with ``route(method, path)``; a refusal or an unexpected
    exception is logged on ``log`` with the method, path and ``where``. ``headers`` are
    added to every reply (e.g. the request id)."""
    method = environ.get("REQUEST_METHOD", "GET")
    path = strip_stage(environ.get("PATH_INFO") or "/", environ.get("serverless.event"))
    reply = guarded(
        log, lambda: route(method, path), method=method[:16], path=path[:200], **(where or {})
    )
    written = [*reply.headers, *(headers or []), ("content-length", str(len(reply.body)))]
    start_response(f"{reply.status} {status_phrase(reply.status)}", written)
    return [reply.body]
