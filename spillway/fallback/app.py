"""The CPU fallback over HTTP: a WSGI application (``spillway serve cpu``, API Gateway).

It serves the Open Inference Protocol paths the fallback supports, and, for local stacks,
Lambda's invoke API (``POST /2015-03-31/functions/{name}/invocations``) answered with the
direct-invoke handler, so the router's ``lambda:Invoke`` path runs end to end on
127.0.0.1 exactly as against ``sam local start-lambda``. Errors are mapped once, by the
core's WSGI entry (``spillway.protocol.wsgi.serve``) the router uses too.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

from spillway import tracing
from spillway.fallback.chain import ClientFault, ServerFault, handle_chain_event, is_chain_event
from spillway.fallback.direct import CPU_SPAN, handle_direct
from spillway.fallback.service import CpuService
from spillway.protocol.errors import RouteNotFoundError
from spillway.protocol.framing import load_json_object, parse_header_length
from spillway.protocol.replies import Reply, infer_reply, json_reply
from spillway.protocol.wire import Target, allow, allow_get, model_target, read_wsgi_body
from spillway.protocol.wsgi import StartResponse, serve

log = logging.getLogger("spillway.cpu_infer")

_INVOKE_PATH = re.compile(r"^/2015-03-31/functions/(?P<name>[^/]+)/invocations$")
_GET_ROUTES = frozenset({"/v2/health/live", "/v2/health/ready", "/v2"})
"""The fallback's fixed paths; each takes ``GET`` alone."""


class CpuApp:
    """WSGI entry point of the CPU fallback."""

    def __init__(self, service: CpuService) -> None:
        self.service = service

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        return serve(
            environ, start_response, log, lambda method, path: self._route(method, path, environ)
        )

    def _route(self, method: str, path: str, environ: dict[str, Any]) -> Reply:
        if (target := model_target(path)) is not None:
            if target.model is None or target.operation == "stats":
                raise RouteNotFoundError(f"the CPU fallback does not serve {target.path}")
            allow(method, path, target.method)
            return self._model(target.model, target, environ)
        if match := _INVOKE_PATH.match(path):
            allow(method, path, "POST")
            return self._invoke(match["name"], self._body(environ))
        allow_get(method, path, _GET_ROUTES)
        if path == "/v2/health/live":
            return json_reply(200, {"live": True})
        if path == "/v2/health/ready":
            return json_reply(200, {"ready": True})
        return json_reply(200, self.service.server_metadata())  # /v2

    def _model(self, model: str, target: Target, environ: dict[str, Any]) -> Reply:
        version, op = target.version, target.operation
        if op == "infer":
            length = parse_header_length(environ.get("HTTP_INFERENCE_HEADER_CONTENT_LENGTH"))
            body = self._body(environ)
            trace = {k: environ.get(f"HTTP_{k.upper()}") for k in tracing.CARRIER_KEYS}
            with (
                tracing.carry(trace),
                tracing.span(CPU_SPAN, kind="server", attributes={"spillway.model": model}) as span,
            ):
                answer = self.service.infer(
                    model, version, body, length, tenant_scope=_tenant_scope(environ)
                )
                span.set("spillway.served_version", answer.version)
            return infer_reply(answer.body, answer.header_length, answer.version)
        if op == "ready":
            self.service.check_ready(model, version)
            return json_reply(200, {"ready": True})
        if op == "config":
            return json_reply(200, self.service.config(model, version))
        return json_reply(200, self.service.metadata(model, version))

    def _invoke(self, name: str, body: bytes) -> Reply:
        if name != self.service.settings.function_name:
            headers = [("x-amzn-errortype", "ResourceNotFoundException")]
            message = {"Type": "User", "message": f"Function not found: {name[:64]}"}
            return json_reply(404, message, headers)
        event = load_json_object(body)
        if is_chain_event(event):  # a state machine's state, as Lambda reports a raise
            try:
                return json_reply(200, handle_chain_event(self.service, event))
            except (ClientFault, ServerFault) as fault:
                error = {"errorMessage": str(fault), "errorType": type(fault).__name__}
                return json_reply(200, error, [("x-amz-function-error", "Unhandled")])
        return json_reply(200, handle_direct(self.service, event))

    def _body(self, environ: dict[str, Any]) -> bytes:
        # The invoke API carries base64 of the body, so allow for its growth by 4/3.
        return read_wsgi_body(environ, self.service.settings.max_payload_bytes * 4 // 3 + 4096)


def _tenant_scope(environ: dict[str, Any]) -> str | None:
    """The tenant scope a router in front sent (proven or not by the service); an API
    Gateway event's header is not even taken (any client could set it there): such a
    request uses no tenant's step cache entries."""
    if environ.get("serverless.event") is not None:
        return None
    value = environ.get("HTTP_X_SPILLWAY_TENANT_SCOPE")
    return value if isinstance(value, str) else None
