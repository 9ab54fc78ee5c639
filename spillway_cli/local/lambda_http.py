"""A Lambda handler behind a local HTTP server, the way API Gateway (REST, proxy
integration) would call it: each request becomes a v1 proxy event, the handler's answer
becomes the response. Used to serve the jobs function on 127.0.0.1. As API Gateway with
API keys does, the event's ``requestContext.identity.apiKeyId`` names the request's
``x-api-key`` (here the key itself); ``requestContext`` is never taken from the request.

The same server answers Lambda's invoke API for the function (``POST
/2015-03-31/functions/{name}/invocations``, the event as the body, the handler's return
value as the answer), so ``lambda:Invoke`` callers such as the router's batch mode reach
it through ``AWS_ENDPOINT_URL_LAMBDA`` as they would reach the function on AWS.

Both doors refuse what AWS refuses, with AWS's answer (``spillway.aws.limits``):

* REST: a body over 10 MB (``REST_PAYLOAD_BYTES``) is API Gateway's own 413, text
  ``HTTP content length exceeded 10485760 bytes.``, the function never called
  (https://docs.aws.amazon.com/apigateway/latest/developerguide/limits.html; the
  REQUEST_TOO_LARGE gateway response cannot be customised:
  https://docs.aws.amazon.com/apigateway/latest/developerguide/supported-gateway-response-types.html);
  an event over Lambda's 6 MB (``LAMBDA_SYNC_PAYLOAD_BYTES``: the body base64-encoded
  with its headers) is 413 ``{"message": "Request Too Long"}``; a function answer over
  6 MB is Lambda's ``Function.ResponseSizeTooLarge``, which API Gateway answers as 502
  ``{"message": "Internal server error"}`` (INTEGRATION_FAILURE)
  (https://docs.aws.amazon.com/lambda/latest/dg/gettingstarted-limits.html; the answers
  as observed on AWS: github.com/koki-develop/lgtm-generator/issues/10,
  github.com/DataBiosphere/azul/issues/8258).
* Invoke: a synchronous payload over 6 MB is 413 ``RequestTooLargeException``, an
  ``Event`` one over 1 MB (``LAMBDA_ASYNC_PAYLOAD_BYTES``) too; an answer over 6 MB is a
  function error (``X-Amz-Function-Error: Unhandled``, ``Function.ResponseSizeTooLarge``)
  (https://docs.aws.amazon.com/lambda/latest/api/API_Invoke.html). An ``Event``
  invocation runs before its 202 here: there is no queue in front of the function.

``api_key_door`` puts a WSGI application behind the REST API's API key check. The local
router, on every runtime, is ``rest_app`` behind it: each request becomes the event API
Gateway would hand the router function — with serverless.yml's ``binaryMediaTypes: ["*/*"]``
every body base64-encoded, ``isBase64Encoded: true`` — handed to the handler in this
process (``wsgi_handler``: the WSGI runtime) or to serverless-offline's Lambda invoke API
(``invoke_handler``), never to serverless-offline's own HTTP server, which decodes a body
as UTF-8 text unless its type is ``application/octet-stream`` (serverless-offline issues
1107 and 1775): a Triton binary-extension body or a page for OCR reaches the function
whole, as on AWS.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Collection, Iterable
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qsl

from spillway.aws.limits import (
    LAMBDA_ASYNC_PAYLOAD_BYTES,
    LAMBDA_SYNC_PAYLOAD_BYTES,
    REST_PAYLOAD_BYTES,
)
from spillway.powertools import API_GATEWAY_TIMEOUT_S
from spillway_cli.local.lambda_runtime import LambdaContext

Handler = Callable[[dict[str, Any], Any], dict[str, Any]]
WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
Answer = tuple[str, list[tuple[str, str]], bytes]
"""A status line, headers and body."""
_INVOKE_PATH = re.compile(r"^/2015-03-31/functions/(?P<name>[^/]+)/invocations$")
_JSON = "application/json"
RESPONSE_TOO_LARGE = "Function.ResponseSizeTooLarge"
"""Lambda's error type for a function answer over the synchronous payload limit."""
log = logging.getLogger("spillway.lambda_http")


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
    """A REST API v1 proxy event for one WSGI request (its length within API Gateway's
    limit: ``_rest`` checks it first)."""
    length = int(environ.get("CONTENT_LENGTH") or 0)
    body = environ["wsgi.input"].read(length) if length else b""
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


def _size(value: Any) -> int:
    """Bytes of ``value`` as JSON: what Lambda counts of an event or an answer."""
    return len(json.dumps(value).encode())


def _json(status: str, value: Any, *headers: tuple[str, str]) -> Answer:
    return status, [("Content-Type", _JSON), *headers], json.dumps(value).encode()


def _too_large(length: int, kind: str, limit: int) -> Answer:
    message = (
        f"{length} byte payload is too large for the {kind} invocation type (limit {limit} bytes)"
    )
    error = ("x-amzn-ErrorType", "RequestTooLargeException")
    return _json("413 Request Entity Too Large", {"Type": "User", "message": message}, error)


def _answer_too_large(size: int, function_name: str) -> dict[str, str]:
    """Lambda's function error for an answer over the synchronous limit (logged)."""
    log.error(
        "function answer over Lambda's payload limit",
        extra={"function": function_name, "bytes": size, "error_type": RESPONSE_TOO_LARGE},
    )
    return {
        "errorMessage": "Response payload size exceeded maximum allowed payload size "
        f"({LAMBDA_SYNC_PAYLOAD_BYTES} bytes).",
        "errorType": RESPONSE_TOO_LARGE,
    }


def _invoke(handler: Handler, function_name: str, environ: dict[str, Any], name: str) -> Answer:
    """Lambda's invoke API for the one function served here."""
    if name.rsplit(":", 1)[-1] != function_name and name != function_name:
        message = {"Type": "User", "message": f"Function not found: {name[:64]}"}
        return _json("404 Not Found", message, ("x-amzn-ErrorType", "ResourceNotFoundException"))
    length = int(environ.get("CONTENT_LENGTH") or 0)
    kind = str(environ.get("HTTP_X_AMZ_INVOCATION_TYPE") or "RequestResponse")
    limit = LAMBDA_ASYNC_PAYLOAD_BYTES if kind == "Event" else LAMBDA_SYNC_PAYLOAD_BYTES
    if length > limit:
        return _too_large(length, kind, limit)
    event = json.loads(environ["wsgi.input"].read(length) or b"{}")
    result = handler(event, _Context())
    if kind == "Event":
        return "202 Accepted", [("Content-Type", _JSON)], b""
    if (size := _size(result)) > LAMBDA_SYNC_PAYLOAD_BYTES:
        error = _answer_too_large(size, function_name)
        return _json("200 OK", error, ("X-Amz-Function-Error", "Unhandled"))
    return _json("200 OK", result)


def _rest(handler: Handler, function_name: str, environ: dict[str, Any]) -> Answer:
    """One REST API request through the proxy integration, API Gateway's limits first."""
    length = int(environ.get("CONTENT_LENGTH") or 0)
    if length > REST_PAYLOAD_BYTES:  # refused before the body is read
        text = f"HTTP content length exceeded {REST_PAYLOAD_BYTES} bytes."
        return (
            "413 Request Entity Too Large",
            [("Content-Type", "text; charset=utf-8")],
            text.encode(),
        )
    event = event_from_environ(environ)
    if _size(event) > LAMBDA_SYNC_PAYLOAD_BYTES:
        error = ("x-amzn-ErrorType", "BadRequestException")
        return _json("413 Request Entity Too Large", {"message": "Request Too Long"}, error)
    result = handler(event, _Context())
    if (size := _size(result)) > LAMBDA_SYNC_PAYLOAD_BYTES:
        _answer_too_large(size, function_name)
        error = ("x-amzn-ErrorType", "InternalServerErrorException")
        return _json("502 Bad Gateway", {"message": "Internal server error"}, error)
    raw = result.get("body") or ""
    body = base64.b64decode(raw) if result.get("isBase64Encoded") else raw.encode()
    status = int(result.get("statusCode", 200))
    headers = [(k, str(v)) for k, v in (result.get("headers") or {}).items()]
    return f"{status} {_phrase(status)}", headers, body


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "-"


def wsgi_app(
    handler: Handler, health_path: str = "/health", function_name: str = "local"
) -> Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]:
    """A WSGI application that calls ``handler`` with API Gateway proxy events (and for
    Lambda invoke calls naming ``function_name``); the health path answers 200 itself
    (API Gateway has no such route)."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == health_path:
            start_response("200 OK", [("Content-Type", _JSON)])
            return [b"{}"]
        invoke = _INVOKE_PATH.match(environ.get("PATH_INFO", ""))
        if invoke and environ["REQUEST_METHOD"] == "POST":
            line, headers, body = _invoke(handler, function_name, environ, invoke["name"])
        else:
            line, headers, body = _rest(handler, function_name, environ)
        start_response(line, headers)
        return [body]

    return app


FORBIDDEN = b'{"message":"Forbidden"}'
"""API Gateway's answer to a request without a valid API key."""


def api_key_door(app: WsgiApp, keys: Collection[str]) -> WsgiApp:
    """``app`` behind a REST API whose methods need an API key (serverless.yml's
    ``private: true`` with a usage plan, the key ``keys`` names at stage ``local``).

    A request whose ``x-api-key`` header is missing or names no key of ``keys`` is API
    Gateway's 403 ``{"message":"Forbidden"}`` (``x-amzn-ErrorType: ForbiddenException``,
    the answer serverless-offline gives too) and never reaches ``app``
    (https://docs.aws.amazon.com/apigateway/latest/developerguide/api-gateway-api-usage-plans.html;
    ``INVALID_API_KEY``, 403:
    https://docs.aws.amazon.com/apigateway/latest/developerguide/supported-gateway-response-types.html).
    A request with one reaches ``app`` as serverless-wsgi hands it an API Gateway event:
    ``environ["serverless.event"]`` holding the key's id in
    ``requestContext.identity.apiKeyId`` — here the key stands for its own id, as
    serverless-offline is told it does (``SLS_API_KEY_ID``) — which the router maps to a
    tenant (``spillway.tenancy.identity``, ``spillway tenants``). A client cannot write
    ``environ`` keys: its headers arrive as ``HTTP_*``."""
    allowed = frozenset(keys)
    if not allowed:
        raise ValueError("an API key door needs at least one key")

    def door(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        key = environ.get("HTTP_X_API_KEY")
        if not isinstance(key, str) or key not in allowed:
            error = ("x-amzn-ErrorType", "ForbiddenException")
            start_response("403 Forbidden", [("Content-Type", _JSON), error])
            return [FORBIDDEN]
        environ["serverless.event"] = {
            "requestContext": {
                "requestId": str(uuid.uuid4()),
                "stage": "local",
                "identity": {"apiKeyId": key, "sourceIp": environ.get("REMOTE_ADDR", "")},
            }
        }
        return app(environ, start_response)

    return door


def rest_app(handler: Handler, function_name: str = "local") -> WsgiApp:
    """Only the REST door: every request is an API Gateway proxy event for ``handler``,
    API Gateway's limits first. No invoke API here (``wsgi_app`` has one): a caller of
    the REST API must not write its own event, ``requestContext`` included."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        line, headers, body = _rest(handler, function_name, environ)
        start_response(line, headers)
        return [body]

    return app


def wsgi_handler(app: WsgiApp, function_name: str = "local") -> Handler:
    """The router function's own conversion around ``app`` (``functions/router/handler.py``
    calls serverless-wsgi: a base64 body decoded, a binary answer encoded; its Powertools
    wrappers are left out, they run per process, not per thread), each event given a
    Lambda context counting down from API Gateway's 29 s."""
    import serverless_wsgi

    def handler(event: dict[str, Any], _context: Any) -> dict[str, Any]:
        lambda_context = LambdaContext(function_name, API_GATEWAY_TIMEOUT_S)
        response: dict[str, Any] = serverless_wsgi.handle_request(app, event, lambda_context)
        return response

    return handler


def _gateway_error(status: int, message: str, error_type: str) -> dict[str, Any]:
    """API Gateway's own answer when the integration fails (the function never answered
    as a proxy integration must)."""
    return {
        "statusCode": status,
        "headers": {"Content-Type": _JSON, "x-amzn-ErrorType": error_type},
        "body": json.dumps({"message": message}),
        "isBase64Encoded": False,
    }


def invoke_handler(
    endpoint: str, function_name: str, timeout_s: float = API_GATEWAY_TIMEOUT_S
) -> Handler:
    """A handler that hands each event to ``function_name`` through Lambda's invoke API at
    ``endpoint`` (serverless-offline's ``--lambdaPort``). As API Gateway answers for a
    proxy integration: no answer within the 29 s integration timeout is 504 ``Endpoint
    request timed out``; a function error or an answer without a ``statusCode`` is 502
    ``Internal server error``
    (https://docs.aws.amazon.com/apigateway/latest/developerguide/limits.html,
    https://docs.aws.amazon.com/apigateway/latest/developerguide/set-up-lambda-proxy-integrations.html)."""
    url = f"{endpoint.rstrip('/')}/2015-03-31/functions/{function_name}/invocations"

    def handler(event: dict[str, Any], _context: Any) -> dict[str, Any]:
        request = urllib.request.Request(url, data=json.dumps(event).encode(), method="POST")  # noqa: S310
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as answer:  # noqa: S310
                failed = answer.headers.get("X-Amz-Function-Error")
                result = json.loads(answer.read() or b"null")
        except TimeoutError:
            return _gateway_error(504, "Endpoint request timed out", "IntegrationTimeout")
        except (urllib.error.URLError, ConnectionError, ValueError) as exc:
            log.error("the function could not be invoked", extra={"error": str(exc)[:200]})
            failed, result = "Unhandled", None
        if failed or not isinstance(result, dict) or "statusCode" not in result:
            log.error("the function failed", extra={"function": function_name})
            return _gateway_error(502, "Internal server error", "InternalServerErrorException")
        return result

    return handler
