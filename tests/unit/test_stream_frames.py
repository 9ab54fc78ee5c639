"""Reading a WebSocket frame: hostile envelopes are refused with a stable code, a good frame
becomes the router's call with the connection's tenant, and replies become answers."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from spillway.policy.facts import read_request
from spillway.protocol.errors import InvalidInputError, InvalidModelNameError
from spillway.protocol.replies import Reply, json_reply
from spillway.streams.frames import (
    MAX_SEQ,
    Answer,
    Frame,
    RefusedFrame,
    frame_bytes,
    read_frame,
    routed,
)
from spillway.streams.settings import StreamSettings

LIMIT = 1024
INPUTS = [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1.0, 2.0]}]


def refusal(data: bytes) -> RefusedFrame:
    with pytest.raises(RefusedFrame) as caught:
        read_frame(data)
    return caught.value


def frame(**fields: Any) -> Frame:
    return read_frame(json.dumps(fields).encode())


@pytest.mark.parametrize(
    "data",
    [
        b"[1, 2]",  # not an object
        b"{",  # not JSON
        b'{"id": "\xff"}',  # not UTF-8
        b'"text"',
        b"\x00\x00\x00\x09{}",  # what was once a binary frame's prefix
    ],
)
def test_an_unreadable_frame_is_refused_with_invalid_frame_and_no_id(data: bytes) -> None:
    # GIVEN a frame whose envelope cannot be read WHEN it is read
    refused = refusal(data)
    # THEN it is refused (400 invalid_frame) and its answer carries "id": null
    assert (refused.error.status, refused.error.code) == (400, "invalid_frame")
    assert refused.answer().body["id"] is None
    assert "seq" not in refused.answer().body


@pytest.mark.parametrize(
    "frame_id", [None, 7, True, "", "a" * 129, "spaces here", "x#y", {"a": 1}, ["a"]]
)
def test_a_frame_without_a_plain_id_is_refused(frame_id: Any) -> None:
    refused = refusal(json.dumps({"id": frame_id, "model": "m"}).encode())
    assert refused.error.code == "invalid_frame"
    assert refused.frame_id is None


@pytest.mark.parametrize("seq", [-1, 1.5, "3", True, False, MAX_SEQ + 1, 10**400, [0], {"n": 1}])
def test_a_seq_that_is_no_non_negative_integer_is_refused_keeping_the_id(seq: Any) -> None:
    refused = refusal(b'{"id": "f1", "seq": ' + json.dumps(seq).encode() + b"}")
    assert refused.error.code == "invalid_frame"
    assert refused.answer().body == {
        "id": "f1",
        "error": f"seq must be an integer from 0 to {MAX_SEQ}",
        "code": "invalid_frame",
        "status": 400,
    }


def test_an_unknown_action_is_refused_with_the_id_and_seq() -> None:
    refused = refusal(b'{"id": "f1", "seq": 4, "action": "delete"}')
    assert (refused.error.code, refused.frame_id, refused.seq) == ("invalid_frame", "f1", 4)


def test_the_size_limit_holds_for_the_frame_s_utf8_bytes() -> None:
    # GIVEN a limit of 1024 bytes
    # WHEN frames over it arrive, in ASCII and in UTF-8 that grows when encoded
    over = ["x" * (LIMIT + 1), "é" * (LIMIT // 2 + 1)]
    # THEN each is refused with 413 message_too_large
    for body in over:
        with pytest.raises(RefusedFrame) as caught:
            frame_bytes(body, False, LIMIT)
        assert (caught.value.error.status, caught.value.error.code) == (413, "message_too_large")
    # AND frames at the limit are taken
    assert len(frame_bytes("x" * LIMIT, False, LIMIT)) == LIMIT
    assert len(frame_bytes("é" * (LIMIT // 2), False, LIMIT)) == LIMIT


@pytest.mark.parametrize("body", [None, 17, "\ud800"])
def test_a_body_that_is_no_frame_is_refused(body: Any) -> None:
    with pytest.raises(RefusedFrame) as caught:
        frame_bytes(body, False, LIMIT)
    assert caught.value.error.code == "invalid_frame"


@pytest.mark.parametrize(
    "body", [base64.b64encode(b'{"id": "f1", "model": "m"}').decode(), "not base64!", "x" * 5000]
)
def test_a_body_marked_base64_is_refused_without_being_decoded(body: str) -> None:
    # GIVEN an event body marked isBase64Encoded (a binary frame, which API Gateway never
    # hands over): valid base64 of a good frame, not base64, over the size limit
    with pytest.raises(RefusedFrame) as caught:
        frame_bytes(body, True, LIMIT)
    # THEN each is refused 400 invalid_frame, the answer saying how to send binary inputs
    answer = caught.value.answer().body
    assert (answer["code"], answer["status"], answer["id"]) == ("invalid_frame", 400, None)
    assert '"content_type": "base64"' in answer["error"]


def test_a_text_frame_becomes_the_v2_request_with_the_connection_s_tenant() -> None:
    # GIVEN a frame naming model, version, seq and another tenant in its parameters
    given = frame(
        id="f-1",
        model="digits",
        version="2",
        seq=0,
        inputs=INPUTS,
        parameters={"tenant": "other", "binary_data_output": True, "priority": 1},
        outputs=[{"name": "y", "parameters": {"binary_data": True}}],
    )
    # WHEN it is routed for a connection of tenant "acme"
    call, target = routed(given, "req-1", 900.0, "acme")
    # THEN the target is the REST API's, the body the V2 request (id kept, frame fields
    # and what would make the answer binary removed) and the tenant the connection's
    assert (target.path, target.model, target.version) == (
        "/v2/models/digits/versions/2/infer",
        "digits",
        "2",
    )
    assert json.loads(call.body) == {
        "id": "f-1",
        "inputs": INPUTS,
        "parameters": {"priority": 1},
        "outputs": [{"name": "y", "parameters": {}}],
    }
    assert (call.method, call.request_id, call.remaining_ms) == ("POST", "req-1", 900.0)
    assert call.headers == {"content-type": "application/json"}
    # AND the router reads "acme" as the tenant even where tenant hints are trusted
    assert read_request(call, target, trust_tenant_hints=True).facts.tenant == "acme"


def test_a_claimed_tenant_does_not_become_an_anonymous_connection_s_tenant() -> None:
    call, target = routed(
        frame(id="f", model="m", inputs=INPUTS, parameters={"tenant": "x"}), "r", None, None
    )
    assert read_request(call, target, trust_tenant_hints=True).facts.tenant is None


def test_a_base64_bytes_input_is_routed_as_sent_in_the_json_body() -> None:
    # GIVEN a frame whose image input is base64 BYTES (content_type base64)
    image = {
        "name": "image",
        "shape": [1],
        "datatype": "BYTES",
        "parameters": {"content_type": "base64"},
        "data": [base64.b64encode(b"\x89PNG\r\n\x1a\n").decode()],
    }
    given = frame(id="img-1", model="ocr-det", seq=3, inputs=[image])
    # WHEN it is routed
    call, target = routed(given, "r", None, "acme")
    # THEN the body is JSON, the input as sent (the serving side decodes it)
    assert call.headers == {"content-type": "application/json"}
    assert json.loads(call.body) == {"id": "img-1", "inputs": [image]}
    assert (given.id, given.seq, target.model) == ("img-1", 3, "ocr-det")


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({}, InvalidInputError),
        ({"model": 5}, InvalidModelNameError),
        ({"model": "../etc"}, InvalidModelNameError),
        ({"model": "a/versions/3"}, InvalidModelNameError),
        ({"model": "Digits"}, InvalidModelNameError),
        ({"model": "m", "version": "1/infer"}, InvalidModelNameError),
        ({"model": "m", "version": 0}, InvalidModelNameError),
        ({"model": "m", "version": True}, InvalidInputError),
        ({"model": "m", "version": 1.5}, InvalidInputError),
    ],
)
def test_model_and_version_are_validated_as_the_rest_api_does(
    fields: dict[str, Any], error: type[Exception]
) -> None:
    with pytest.raises(error):
        routed(frame(id="f", **fields), "r", None, "acme")


def test_a_success_reply_becomes_the_v2_response_with_id_seq_and_spillway() -> None:
    # GIVEN the router's 200 with its explaining headers
    body = {"model_name": "digits", "model_version": "1", "outputs": []}
    extra = [
        ("x-spillway-rule", "default"),
        ("x-spillway-backend", "cpu"),
        ("x-spillway-cost-usd", "0.000001250"),
        ("x-spillway-fallback", "gpu:unavailable"),
    ]
    reply = json_reply(200, body, extra)
    # WHEN it answers frame f1 (seq 2)
    answer = Answer.of_reply(frame(id="f1", seq=2, model="digits"), reply)
    # THEN the answer is the response plus id, seq and what the router did
    assert answer.ok
    assert (answer.cost_usd, answer.backend) == (1.25e-6, "cpu")
    assert json.loads(answer.data) == {
        **body,
        "id": "f1",
        "seq": 2,
        "spillway": {
            "backend": "cpu",
            "rule": "default",
            "cost_usd": 1.25e-6,
            "fallback": "gpu:unavailable",
        },
    }


def test_a_router_error_keeps_its_code_and_status() -> None:
    reply = json_reply(404, {"error": "unknown model 'x'", "code": "model_not_found"})
    answer = Answer.of_reply(frame(id="f1", model="x"), reply)
    assert not answer.ok
    assert answer.body == {
        "id": "f1",
        "error": "unknown model 'x'",
        "code": "model_not_found",
        "status": 404,
    }


def test_a_reply_that_is_no_json_object_is_an_internal_failure() -> None:
    answer = Answer.of_reply(frame(id="f1", model="x"), Reply(200, [], b"\x00binary"))
    assert (answer.ok, answer.body["code"], answer.body["status"]) == (False, "internal", 500)


def test_settings_defaults_and_environment() -> None:
    settings = StreamSettings.from_env(
        {"WS_MAX_IN_FLIGHT": "4", "WS_MANAGEMENT_ENDPOINT": "http://127.0.0.1:9/"}
    )
    assert (settings.max_in_flight, settings.management_endpoint) == (4, "http://127.0.0.1:9")
    defaults = StreamSettings.from_env({})
    assert (defaults.max_in_flight, defaults.max_message_bytes, defaults.connection_ttl_s) == (
        32,
        131072,
        10800,
    )
    with pytest.raises(ValueError, match="http"):
        StreamSettings.from_env({"WS_MANAGEMENT_ENDPOINT": "ftp://x"})
