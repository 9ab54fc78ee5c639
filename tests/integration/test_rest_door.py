"""The REST API's door the local router sits behind on every runtime
(``spillway_cli.local.lambda_http``: ``rest_app`` with ``wsgi_handler`` or
``invoke_handler``), on real HTTP on 127.0.0.1.

GIVEN the door in front of a function reached through Lambda's invoke API (as
serverless-offline's ``--lambdaPort`` serves it; here ``lambda_http.wsgi_app``'s)
WHEN a body that is not UTF-8 text is sent, with or without a content type
THEN the function's event carries it base64-encoded with ``isBase64Encoded: true``, as
API Gateway hands it with ``binaryMediaTypes: ["*/*"]``, and serverless-wsgi gives the
application the same bytes; a function that fails is API Gateway's 502, one that does
not answer within the integration timeout its 504, and the door's own key check is 403.
"""

from __future__ import annotations

import base64
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest

from spillway_cli.local.lambda_http import (
    api_key_door,
    invoke_handler,
    rest_app,
    wsgi_app,
    wsgi_handler,
)
from spillway_cli.local.wsgi_server import running

FUNCTION = "spillway-local-router"
KEY = "k-local"
BODY = bytes(range(256)) * 4 + b"\xff\xfe\x80"
"""Every byte value, and sequences that are not UTF-8."""


def _echo(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    """A WSGI app that answers the bytes it was given."""
    body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
    start_response("200 OK", [("Content-Type", "application/octet-stream")])
    return [body]


class Function:
    """The router function's stand-in: serverless-wsgi around ``_echo``, recording each
    event; ``fail`` makes it raise, ``hold`` makes it wait until released."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.fail = False
        self.hold = threading.Event()
        self.hold.set()
        self._handler = wsgi_handler(_echo, FUNCTION)

    def __call__(self, event: dict[str, Any], context: Any) -> dict[str, Any]:
        self.events.append(event)
        if self.fail:
            raise RuntimeError("the function failed")
        self.hold.wait(30)
        return self._handler(event, context)


@pytest.fixture
def function() -> Function:
    return Function()


@pytest.fixture
def door(function: Function) -> Iterator[str]:
    with (
        running(wsgi_app(function, function_name=FUNCTION)) as lambda_url,
        running(
            api_key_door(rest_app(invoke_handler(lambda_url, FUNCTION, timeout_s=1.0)), [KEY])
        ) as url,
    ):
        yield url


def _post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@pytest.mark.parametrize(
    "content_type", [None, "application/vnd.sagemaker-triton.binary+json", "text/plain"]
)
def test_a_binary_body_reaches_the_function_whole(
    door: str, function: Function, content_type: str | None
) -> None:
    headers = {"x-api-key": KEY, **({"content-type": content_type} if content_type else {})}
    # WHEN a body that is not UTF-8 goes through the door
    status, answer = _post(f"{door}/v2/models/digits/infer", BODY, headers)
    # THEN the event carries it base64-encoded, and the application got every byte
    (event,) = function.events
    assert event["isBase64Encoded"] is True
    assert base64.b64decode(event["body"]) == BODY
    assert event["requestContext"]["identity"]["apiKeyId"] == KEY
    assert (status, answer) == (200, BODY)


def test_a_failed_function_is_api_gateways_502(door: str, function: Function) -> None:
    function.fail = True
    status, answer = _post(f"{door}/v2/models/digits/infer", b"{}", {"x-api-key": KEY})
    assert (status, answer) == (502, b'{"message": "Internal server error"}')


def test_a_function_past_the_integration_timeout_is_504(door: str, function: Function) -> None:
    function.hold.clear()
    try:
        status, answer = _post(f"{door}/v2/models/digits/infer", b"{}", {"x-api-key": KEY})
    finally:
        function.hold.set()
    assert (status, answer) == (504, b'{"message": "Endpoint request timed out"}')


def test_a_request_without_the_key_never_reaches_the_function(
    door: str, function: Function
) -> None:
    status, answer = _post(f"{door}/v2/models/digits/infer", BODY, {"x-api-key": "other"})
    assert (status, answer) == (403, b'{"message":"Forbidden"}')
    assert function.events == []
