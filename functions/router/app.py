"""The router's HTTP transport: a plain WSGI application.

It only translates: find the route, read the body within its cap, hand the request to
the dispatcher, write the reply. Errors are mapped here once: a ``SpillwayError`` becomes
its status and ``{"error", "code"}`` body (with ``Retry-After`` when it carries one);
anything else is logged with its traceback and answered with a generic 500.

The same application runs behind API Gateway (serverless-wsgi, REST v1 and HTTP API v2
events: an HTTP API stage name at the front of the path is removed) and on 127.0.0.1.
A tenant set by an API Gateway authorizer wins over the tenant a request claims.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterable
from http import HTTPStatus
from typing import Any

from functions.router.dispatch import Call, Dispatcher, Reply, RoutedError, Target
from functions.router.facts import check_model_name, check_version
from spillway import __version__
from spillway.errors import (
    MethodNotAllowedError,
    PayloadTooLargeError,
    RouteNotFoundError,
    SpillwayError,
)

log = logging.getLogger("spillway.router")

StartResponse = Callable[[str, list[tuple[str, str]]], Any]
_MODEL_PATH = re.compile(
    r"^/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?"
    r"(?:/(?P<op>ready|config|stats|infer))?$"
)
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_JSON = ("content-type", "application/json")
EXTENSIONS = ["binary_tensor_data", "statistics", "model_configuration"]


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


class RouterApp:
    """WSGI entry point of the router."""

    def __init__(self, dispatcher: Dispatcher, *, max_body_bytes: int, openapi: bytes) -> None:
        self.dispatcher = dispatcher
        self.max_body_bytes = max_body_bytes
        self.openapi = openapi

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        request_id = _request_id(environ)
        method, path = environ.get("REQUEST_METHOD", "GET"), _path(environ)
        try:
            reply = self._route(method, path, environ, request_id)
        except RoutedError as routed:
            reply = _error_reply(routed.error, routed.headers)
        except SpillwayError as error:
            reply = _error_reply(error, [])
            log.info("%s %s -> %d %s: %s", method, path, error.status, error.code, error.message)
        except Exception:
            log.exception("unhandled error on %s %s", method, path)
            reply = Reply(500, [_JSON], _json({"error": "internal error", "code": "internal"}))
        headers = [*reply.headers, ("x-request-id", request_id)]
        headers.append(("content-length", str(len(reply.body))))
        start_response(f"{reply.status} {_phrase(reply.status)}", headers)
        return [reply.body]

    def _route(self, method: str, path: str, environ: dict[str, Any], request_id: str) -> Reply:
        if path.startswith("/v2/models/"):
            match = _MODEL_PATH.match(path)
            if match is None:
                raise RouteNotFoundError(f"no route for {path[:200]}")
            return self._model_route(method, match, environ, request_id)
        _allow(method, path, "GET")
        if path == "/v2/health/live":
            return Reply(200, [_JSON], _json({"live": True}))
        if path == "/v2/health/ready":
            if self.dispatcher.ready():
                return Reply(200, [_JSON], _json({"ready": True}))
            error = {"error": "no backend can serve now", "code": "not_ready"}
            return Reply(400, [_JSON], _json(error))
        if path == "/v2":
            metadata = {"name": "spillway-router", "version": __version__, "extensions": EXTENSIONS}
            return Reply(200, [_JSON], _json(metadata))
        if path == "/openapi.json":
            return Reply(200, [_JSON], self.openapi)
        raise RouteNotFoundError(f"no route for {path[:200]}")

    def _model_route(
        self, method: str, match: re.Match[str], environ: dict[str, Any], request_id: str
    ) -> Reply:
        target = target_of(match)
        _allow(method, match.string, "POST" if target.operation == "infer" else "GET")
        return self.dispatcher.forward(self._call(method, environ, request_id), target)

    def _call(self, method: str, environ: dict[str, Any], request_id: str) -> Call:
        context = environ.get("serverless.context")
        remaining = getattr(context, "get_remaining_time_in_millis", None)
        return Call(
            method=method,
            headers=_headers(environ),
            body=self._body(environ) if method == "POST" else b"",
            request_id=request_id,
            remaining_ms=float(remaining()) if callable(remaining) else None,
            trusted_tenant=_authorizer_tenant(environ.get("serverless.authorizer")),
        )

    def _body(self, environ: dict[str, Any]) -> bytes:
        limit = self.max_body_bytes
        declared = environ.get("CONTENT_LENGTH") or ""
        stream = environ["wsgi.input"]
        if declared.isdigit():
            if int(declared) > limit:
                raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
            return bytes(stream.read(int(declared)))
        if environ.get("wsgi.input_terminated"):
            body = bytes(stream.read(limit + 1))
            if len(body) > limit:
                raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
            return body
        return b""


def model_target(path: str) -> Target:
    """The target of a ``/v2/models/...`` path (names validated); 404 for other paths."""
    match = _MODEL_PATH.match(path)
    if match is None:
        raise RouteNotFoundError(f"no route for {path[:200]}")
    return target_of(match)


def target_of(match: re.Match[str]) -> Target:
    """The target a matched model path names; model and version are validated."""
    model, version, op = match["model"], match["version"], match["op"]
    if model == "stats" and version is None and op is None:
        return Target("stats")
    checked = None if version is None else check_version(version)
    return Target(op or "metadata", check_model_name(model), checked)


class _MethodNotAllowed(MethodNotAllowedError):
    def __init__(self, method: str, path: str, allowed: str) -> None:
        super().__init__(f"{method[:16]} is not allowed on {path[:200]}")
        self.allow = allowed


def _allow(method: str, path: str, allowed: str) -> None:
    if method != allowed:
        raise _MethodNotAllowed(method, path, allowed)


def _error_reply(error: SpillwayError, extra: list[tuple[str, str]]) -> Reply:
    headers = [_JSON, *extra]
    if error.retry_after_s is not None:
        headers.append(("retry-after", str(max(1, round(error.retry_after_s)))))
    if isinstance(error, _MethodNotAllowed):
        headers.append(("allow", error.allow))
    return Reply(error.status, headers, _json(error.to_body()))


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def _path(environ: dict[str, Any]) -> str:
    path = environ.get("PATH_INFO") or "/"
    event = environ.get("serverless.event")
    if isinstance(event, dict) and event.get("version") == "2.0":
        # An HTTP API with a named stage keeps the stage in rawPath; REST APIs do not.
        stage = (event.get("requestContext") or {}).get("stage")
        if stage and stage != "$default" and path.startswith(f"/{stage}/"):
            path = path[len(stage) + 1 :]
    return path


def _headers(environ: dict[str, Any]) -> dict[str, str]:
    headers = {
        key[5:].replace("_", "-").lower(): value
        for key, value in environ.items()
        if key.startswith("HTTP_") and isinstance(value, str)
    }
    if environ.get("CONTENT_TYPE"):
        headers["content-type"] = environ["CONTENT_TYPE"]
    return headers


def _request_id(environ: dict[str, Any]) -> str:
    given = environ.get("HTTP_X_REQUEST_ID")
    if isinstance(given, str) and _REQUEST_ID.fullmatch(given):
        return given
    event = environ.get("serverless.event")
    if isinstance(event, dict):
        aws_id = (event.get("requestContext") or {}).get("requestId")
        if isinstance(aws_id, str) and _REQUEST_ID.fullmatch(aws_id):
            return aws_id
    return os.urandom(16).hex()


def _authorizer_tenant(authorizer: object) -> str | None:
    """``tenant`` from a Lambda authorizer's context or a JWT authorizer's claims."""
    if not isinstance(authorizer, dict):
        return None
    claims = (authorizer.get("jwt") or {}).get("claims")
    for scope in (authorizer, authorizer.get("lambda"), claims):
        if isinstance(scope, dict) and isinstance(scope.get("tenant"), str):
            return str(scope["tenant"])
    return None
