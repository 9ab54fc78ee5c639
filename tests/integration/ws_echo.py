"""A WebSocket Lambda handler for the local gateway's tests (``tests.integration.ws_echo.handler``).

Every event is appended as one JSON line to the file ``ECHO_EVENTS`` names. ``$connect``
is refused with 401 unless the upgrade request carries ``x-echo-allow``. A message is
answered through the management API (boto3's ``apigatewaymanagementapi`` client at
``WS_MANAGEMENT_ENDPOINT``), as the real handler answers:

- ``{"op": "echo", ...}``: the message itself;
- ``{"op": "event"}``: the event the message arrived in;
- ``{"op": "meet", "tag": t}``: waits until a second ``meet`` runs at the same time (a
  barrier; fails after 20 s when the two invocations do not overlap), then ``{"met": t}``;
- ``{"op": "raise"}``: raises.

The gateway invokes it for text messages only (a binary frame closes the connection).
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import boto3

_meeting = threading.Barrier(2, timeout=20)
_lock = threading.Lock()
_client: Any = None


def _management() -> Any:
    global _client
    with _lock:
        if _client is None:
            _client = boto3.client(
                "apigatewaymanagementapi",
                endpoint_url=os.environ["WS_MANAGEMENT_ENDPOINT"],
                region_name="us-east-1",
            )
        return _client


def _record(event: dict[str, Any]) -> None:
    with _lock, open(os.environ["ECHO_EVENTS"], "a", encoding="utf-8") as log:
        log.write(json.dumps(event) + "\n")


def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    _record(event)
    route = event["requestContext"]["routeKey"]
    if route == "$connect":
        headers = {k.lower() for k in event.get("headers", {})}
        return {"statusCode": 200 if "x-echo-allow" in headers else 401}
    if route == "$disconnect":
        return {"statusCode": 200}
    assert context.get_remaining_time_in_millis() > 0
    connection = event["requestContext"]["connectionId"]
    push = _management().post_to_connection
    message = json.loads(event["body"])
    if message["op"] == "raise":
        raise RuntimeError("the handler failed")
    if message["op"] == "meet":
        _meeting.wait()
        answer: Any = {"met": message["tag"]}
    elif message["op"] == "event":
        answer = event
    else:
        answer = message
    push(ConnectionId=connection, Data=json.dumps(answer).encode())
    return {"statusCode": 200}
