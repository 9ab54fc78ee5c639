"""The local REST door and Lambda invoke API (``spillway_cli.local.lambda_http``) refuse what
API Gateway and Lambda refuse, with their answers.

API Gateway (REST): a body over 10 MB is its own 413 before any function runs; an event
over Lambda's 6 MB is 413 ``{"message": "Request Too Long"}``; a function answer over
6 MB is Lambda's ``Function.ResponseSizeTooLarge``, answered 502 ``{"message": "Internal
server error"}``. Lambda's invoke API: a payload over 6 MB (``Event``: 1 MB) is 413
``RequestTooLargeException``; an answer over 6 MB a function error. The body the router
accepts (``SYNC_BODY_BYTES``) passes the door.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError
from werkzeug.test import Client

from spillway.aws.limits import (
    LAMBDA_ASYNC_PAYLOAD_BYTES,
    LAMBDA_SYNC_PAYLOAD_BYTES,
    REST_PAYLOAD_BYTES,
)
from spillway.protocol.wire import SYNC_BODY_BYTES
from spillway_cli.local.lambda_http import wsgi_app
from spillway_cli.local.wsgi_server import running

FUNCTION = "spillway-local-echo"


class Echo:
    """A handler that counts its calls and answers ``answer_bytes`` of body (proxy
    events) or of a ``pad`` field (invoke events)."""

    def __init__(self, answer_bytes: int = 2) -> None:
        self.calls = 0
        self.answer_bytes = answer_bytes

    def __call__(self, event: dict[str, Any], context: Any) -> dict[str, Any]:
        self.calls += 1
        if "httpMethod" in event:
            return {"statusCode": 200, "body": "x" * self.answer_bytes}
        return {"pad": "x" * self.answer_bytes}


def _post(handler: Echo, size: int) -> Any:
    client = Client(wsgi_app(handler, function_name=FUNCTION))
    return client.post("/v1/jobs", data=b"a" * size, headers={"content-type": "text/plain"})


def test_a_body_over_10_mb_is_api_gateways_413_and_runs_nothing() -> None:
    handler = Echo()
    # WHEN a request carries one byte more than API Gateway's 10 MB
    answer = _post(handler, REST_PAYLOAD_BYTES + 1)
    # THEN it is API Gateway's own refusal, the function never called
    assert answer.status_code == 413
    assert answer.data == b"HTTP content length exceeded 10485760 bytes."
    assert handler.calls == 0


def test_an_event_over_6_mb_is_request_too_long() -> None:
    handler = Echo()
    # WHEN a body within 10 MB makes an event over 6 MB (base64: 4/3 of the body)
    answer = _post(handler, LAMBDA_SYNC_PAYLOAD_BYTES * 3 // 4 + 1)
    # THEN it is 413 Request Too Long, the function never called
    assert answer.status_code == 413
    assert json.loads(answer.data) == {"message": "Request Too Long"}
    assert handler.calls == 0


def test_the_largest_body_the_router_accepts_passes_the_door() -> None:
    handler = Echo()
    # WHEN a request carries the router's own largest synchronous body
    answer = _post(handler, SYNC_BODY_BYTES)
    # THEN the function runs and answers
    assert (answer.status_code, handler.calls) == (200, 1)


def test_an_answer_over_6_mb_is_a_502() -> None:
    # GIVEN a function whose answer is over Lambda's 6 MB
    handler = Echo(answer_bytes=LAMBDA_SYNC_PAYLOAD_BYTES)
    # WHEN it is called through the REST door
    answer = _post(handler, 10)
    # THEN it ran, and API Gateway answers 502 Internal server error
    assert handler.calls == 1
    assert answer.status_code == 502
    assert json.loads(answer.data) == {"message": "Internal server error"}


@pytest.fixture
def invoke(aws_env: str) -> Iterator[tuple[Any, Echo]]:
    handler = Echo()
    with running(wsgi_app(handler, function_name=FUNCTION)) as url:
        config = Config(retries={"mode": "standard", "max_attempts": 1}, read_timeout=60)
        yield boto3.client("lambda", endpoint_url=url, config=config), handler


def test_an_invoke_payload_over_6_mb_is_request_too_large(invoke: tuple[Any, Echo]) -> None:
    client, handler = invoke
    # WHEN a synchronous invoke carries a payload one byte over 6 MB
    payload = json.dumps({"pad": "x" * (LAMBDA_SYNC_PAYLOAD_BYTES - 10)})
    assert len(payload) == LAMBDA_SYNC_PAYLOAD_BYTES + 1
    with pytest.raises(ClientError) as raised:
        client.invoke(FunctionName=FUNCTION, Payload=payload)
    # THEN Lambda's RequestTooLargeException (413), the function never called
    error = raised.value.response
    assert (error["Error"]["Code"], error["ResponseMetadata"]["HTTPStatusCode"]) == (
        "RequestTooLargeException",
        413,
    )
    assert handler.calls == 0


def test_an_event_invoke_payload_over_1_mb_is_request_too_large(
    invoke: tuple[Any, Echo],
) -> None:
    client, handler = invoke
    # WHEN asynchronous invokes carry exactly 1 MB and one byte more
    fits = json.dumps({"pad": "x" * (LAMBDA_ASYNC_PAYLOAD_BYTES - 11)})
    over = json.dumps({"pad": "x" * (LAMBDA_ASYNC_PAYLOAD_BYTES - 10)})
    assert (len(fits), len(over)) == (LAMBDA_ASYNC_PAYLOAD_BYTES, LAMBDA_ASYNC_PAYLOAD_BYTES + 1)
    accepted = client.invoke(FunctionName=FUNCTION, InvocationType="Event", Payload=fits)
    with pytest.raises(ClientError) as raised:
        client.invoke(FunctionName=FUNCTION, InvocationType="Event", Payload=over)
    # THEN the first is accepted (202), the second RequestTooLargeException
    assert accepted["StatusCode"] == 202
    assert raised.value.response["Error"]["Code"] == "RequestTooLargeException"
    assert handler.calls == 1


def test_an_invoke_answer_over_6_mb_is_a_function_error(invoke: tuple[Any, Echo]) -> None:
    client, handler = invoke
    # GIVEN a function whose answer is over 6 MB
    handler.answer_bytes = LAMBDA_SYNC_PAYLOAD_BYTES
    # WHEN it is invoked synchronously
    answer = client.invoke(FunctionName=FUNCTION, Payload=b"{}")
    # THEN the call succeeds with Lambda's function error, not the answer
    assert answer["FunctionError"] == "Unhandled"
    error = json.loads(answer["Payload"].read())
    assert error["errorType"] == "Function.ResponseSizeTooLarge"
    assert handler.calls == 1
