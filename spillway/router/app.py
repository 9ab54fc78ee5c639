"""The router's HTTP transport: a plain WSGI application.

It only translates: find the route, read the body within its cap, hand the request to
the router (the OpenAI-compatible paths to ``openai_compat.door``, which hands it to the
same router), write the reply. Errors are mapped once, by the core's WSGI entry
(``spillway.protocol.wsgi.serve``): a ``SpillwayError`` becomes its status,
``{"error", "code"}`` body and ``Retry-After`` or ``Allow`` header; anything else is
logged with its traceback and answered with a generic 500.

The same application runs behind API Gateway (serverless-wsgi, REST v1 and HTTP API v2
events: an HTTP API stage name at the front of the path is removed) and on 127.0.0.1.
A tenant set by an API Gateway authorizer wins over the tenant a request claims.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from spillway import __version__
from spillway.policy.facts import Call
from spillway.powertools import remaining_ms
from spillway.protocol.errors import RouteNotFoundError
from spillway.protocol.framing import JSON_CONTENT_TYPE
from spillway.protocol.replies import Reply, json_reply
from spillway.protocol.wire import allow, allow_get, no_route, read_wsgi_body, require_model_target
from spillway.protocol.wsgi import StartResponse, serve
from spillway.router.async_mode import RESULTS_PREFIX
from spillway.router.dispatch import Router
from spillway.router.openai_compat import door as openai_door
from spillway.router.openai_compat.door import OpenAIDoor
from spillway.router.sessions import PREFIX as SESSIONS_PREFIX
from spillway.router.sessions import Sessions
from spillway.tenancy.directory import LiveConfigCache
from spillway.tenancy.identity import vouched_tenant

log = logging.getLogger("spillway.router")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
EXTENSIONS = ["binary_tensor_data", "statistics", "model_configuration"]
_GET_ROUTES = frozenset({"/v2/health/live", "/v2/health/ready", "/v2", "/openapi.json"})
"""The router's fixed paths; each takes ``GET`` alone."""


class RouterApp:
    """WSGI entry point of the router."""

    def __init__(
        self,
        router: Router,
        *,
        max_body_bytes: int,
        openapi: bytes,
        identity_tenants: Mapping[str, str] | None = None,
        sessions: Sessions | None = None,
        live: LiveConfigCache | None = None,
        openai: OpenAIDoor | None = None,
    ) -> None:
        self.router = router
        self.openai = openai if openai is not None else OpenAIDoor(router, None)
        """The OpenAI-compatible paths (``/v1/embeddings``, ``/v1/models``)."""
        self.max_body_bytes = max_body_bytes
        self.openapi = openapi
        # Kept as given: a ``TenantDirectory`` is read afresh at each lookup.
        self.identity_tenants: Mapping[str, str] = (
            identity_tenants if identity_tenants is not None else {}
        )
        self.sessions = sessions
        self.live = live
        """The live configuration behind ``identity_tenants``; the handler polls it for
        the log level (``None``: a static map)."""

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        request_id = _request_id(environ)
        return serve(
            environ,
            start_response,
            log,
            lambda method, path: self._route(method, path, environ, request_id),
            where={"request_id": request_id},
            headers=[("x-request-id", request_id)],
        )

    def _route(self, method: str, path: str, environ: dict[str, Any], request_id: str) -> Reply:
        if path.startswith("/v2/models/"):
            target = require_model_target(path)
            allow(method, path, target.method)
            return self.router.route(self._call(method, environ, request_id), target)
        if openai_door.serves(path):
            # The body is read inside the door, so that a refusal is in OpenAI's shape too.
            read = functools.partial(self._call, method, environ, request_id)
            return self.openai.answer(method, path, read, {"request_id": request_id})
        if path.startswith(SESSIONS_PREFIX) and self.sessions is not None:
            call = Call(method, _headers(environ), b"", request_id, None, self._tenant(environ))
            return self.sessions.handle(path, call, lambda limit: read_wsgi_body(environ, limit))
        if path.startswith(RESULTS_PREFIX):
            allow(method, path, "GET")
            if self.router.async_front is None:
                raise RouteNotFoundError("async mode is not offered by this deployment")
            tenant = self._tenant(environ)
            if tenant is None and self.router.config.trust_tenant_hints:
                tenant = _headers(environ).get("x-spillway-tenant") or None
            return self.router.async_front.result(path, tenant)
        allow_get(method, path, _GET_ROUTES)
        if path == "/v2/health/live":
            return json_reply(200, {"live": True})
        if path == "/v2/health/ready":
            if self.router.ready():
                return json_reply(200, {"ready": True})
            return json_reply(400, {"error": "no backend can serve now", "code": "not_ready"})
        if path == "/v2":
            metadata = {"name": "spillway-router", "version": __version__, "extensions": EXTENSIONS}
            return json_reply(200, metadata)
        if path == "/openapi.json":
            return Reply(200, [("content-type", JSON_CONTENT_TYPE)], self.openapi)
        raise no_route(path)

    def _call(self, method: str, environ: dict[str, Any], request_id: str) -> Call:
        return Call(
            method=method,
            headers=_headers(environ),
            body=self._body(environ) if method == "POST" else b"",
            request_id=request_id,
            remaining_ms=remaining_ms(environ.get("serverless.context")),
            trusted_tenant=self._tenant(environ),
        )

    def _tenant(self, environ: dict[str, Any]) -> str | None:
        """The caller's tenant as API Gateway vouches for it: an authorizer's ``tenant``,
        else the authenticated identity (API key id or IAM principal) through the
        ``identity_tenants`` map (an unmapped identity is its own tenant)."""
        return vouched_tenant(
            environ.get("serverless.authorizer"),
            environ.get("serverless.event"),
            self.identity_tenants,
        )

    def _body(self, environ: dict[str, Any]) -> bytes:
        return read_wsgi_body(environ, self.max_body_bytes)


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
