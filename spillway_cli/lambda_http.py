"""A Lambda handler behind a local HTTP server, the way API Gateway (REST, proxy
integration) would call it: each request becomes a v1 proxy event, the handler's answer
becomes the response. Used to serve the jobs function on 127.0.0.1. As API Gateway with
API keys does, the event's ``requestContext.identity.apiKeyId`` names the request's
``x-api-key`` (here the key itself); ``requestContext`` is never taken from the request.

The same server answers Lambda's invoke API for the function (``POST
/2015-03-31/functions/{name}/invocations``, the event as the body, the handler's return
value as the answer), so ``lambda:Invoke`` callers such as the router's batch mode reach
it through ``AWS_ENDPOINT_URL_LAMBDA`` as they would reach the function on AWS."""

from __future__ import annotations

import base64
import json
import re
import uuid
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qsl

Handler = Callable[[dict[str, Any], Any], dict[str, Any]]
_MAX_BODY = 10 * 1024 * 1024  # API Gateway's limit
_INVOKE_PATH = re.compile(r"^/2015-03-31/functions/(?P<name>[^/]+)/invocations$")
_INVOKE_LIMIT = 6 * 1024 * 1024  # Lambda's synchronous payload


class _Context:
    """The parts of a Lambda context a handler may read."""

    function_name = "local"
    memory_limit_in_mb = 512

    def __init__(self) -> None:
        self.aws_request_id = str(uuid.uuid4())

    @staticmethod
    def get_remaining_time_in_millis() -> int:
        return 30_000


def event_from_environ(environ: dict[str, Any]) -> dict[str, Any]:
    """A REST API v1 proxy event for one WSGI request."""
    length = int(environ.get("CONTENT_LENGTH") or 0)
    body = environ["wsgi.input"].read(min(length, _MAX_BODY)) if length else b""
    headers = {
        k[5:].replace("_", "-").title(): v for k, v in environ.items() if k.startswith("HTTP_")
    }
    if environ.get("CONTENT_TYPE"):
        headers["Content-Type"] = environ["CONTENT_TYPE"]
    query = dict(parse_qsl(environ.get("QUERY_STRING", "")))
    return {
        "resource": "/{proxy+}",
        "path": environ.get("PATH_INFO", "/"),
        "httpMethod": environ["REQUEST_METHOD"],
        "headers": headers,
        "queryStringParameters": query or None,
        "requestContext": {
            "requestId": str(uuid.uuid4()),
            "stage": "local",
            "apiId": "local",
            # API Gateway puts the id of the API key a request carried here; locally a key
            # stands for its own id (map it with JOBS_IDENTITY_TENANTS).
            "identity": {"apiKeyId": headers.get("X-Api-Key"), "sourceIp": "127.0.0.1"},
        },
        "body": base64.b64encode(body).decode() if body else None,
        "isBase64Encoded": bool(body),
    }


def _invoke(
    handler: Handler, function_name: str, environ: dict[str, Any], name: str
) -> tuple[str, bytes]:
    """Lambda's invoke API for the one function served here: its status and JSON body."""
    if name.rsplit(":", 1)[-1] != function_name and name != function_name:
        message = {"Type": "User", "message": f"Function not found: {name[:64]}"}
        return "404 Not Found", json.dumps(message).encode()
    length = int(environ.get("CONTENT_LENGTH") or 0)
    if length > _INVOKE_LIMIT:
        message = {"Type": "User", "message": f"{length} byte payload is too large"}
        return "413 Request Entity Too Large", json.dumps(message).encode()
    event = json.loads(environ["wsgi.input"].read(length) or b"{}")
    return "200 OK", json.dumps(handler(event, _Context())).encode()


def wsgi_app(
    handler: Handler, health_path: str = "/health", function_name: str = "local"
) -> Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]:
    """A WSGI application that calls ``handler`` with API Gateway proxy events (and for
    Lambda invoke calls naming ``function_name``); the health path answers 200 itself
    (API Gateway has no such route)."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == health_path:
            start_response("200 OK", [("Content-Type", "application/json")])
            return [b"{}"]
        invoke = _INVOKE_PATH.match(environ.get("PATH_INFO", ""))
        if invoke and environ["REQUEST_METHOD"] == "POST":
            line, answer = _invoke(handler, function_name, environ, invoke["name"])
            start_response(line, [("Content-Type", "application/json")])
            return [answer]
        result = handler(event_from_environ(environ), _Context())
        raw = result.get("body") or ""
        body = base64.b64decode(raw) if result.get("isBase64Encoded") else raw.encode()
        status = int(result.get("statusCode", 200))
        headers = [(k, str(v)) for k, v in (result.get("headers") or {}).items()]
        start_response(f"{status} -", headers)
        return [body]

    return app
