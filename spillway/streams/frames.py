"""One WebSocket frame in, one answer out: reading, routing and answering a frame.

A frame is one text message holding one JSON object: a V2 infer request plus ``id`` (the
client's), ``model``, optional ``version``, optional ``seq`` and optional ``action``
(``infer`` or ``stats``). There are no binary frames: API Gateway's WebSocket APIs take
text frames only (a binary frame closes the connection with 1003,
https://docs.aws.amazon.com/apigateway/latest/developerguide/websocket-api-develop-binary-media-types.html),
so a binary input (an image file) travels as a BYTES input whose JSON strings are base64,
``"parameters": {"content_type": "base64"}`` (``spillway.protocol.tensors``).

Reading happens in two steps, because they fail differently:

- ``read_frame`` reads the envelope (size, JSON, ``id``, ``seq``, ``action``). A frame that
  fails here is *refused* (``RefusedFrame``): answered at once, outside any order, and its
  ``seq`` stays open for the client to send again.
- ``routed`` turns an accepted frame into the router's ``Call`` and ``Target``. What fails
  here (a bad model name, a malformed V2 request) is the frame's answer, delivered in its
  place in the order like any other answer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from spillway.policy.facts import Call
from spillway.protocol.errors import (
    InvalidFrameError,
    InvalidInputError,
    MessageTooLargeError,
    SpillwayError,
)
from spillway.protocol.framing import JSON_CONTENT_TYPE, load_json_object
from spillway.protocol.names import validate_model_name, validate_version
from spillway.protocol.replies import Reply, json_bytes
from spillway.protocol.wire import Target, require_model_target

FRAME_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
MAX_SEQ = 2**53 - 1
"""The largest ``seq`` (JavaScript's largest exact integer)."""
ACTIONS = ("infer", "stats")
_ENVELOPE = ("model", "version", "seq", "action")
"""The frame's own fields, removed from the V2 request (``id`` stays: V2 has one)."""


class RefusedFrame(Exception):  # a frame refused, not an error
    """A frame answered at once and not processed: what it was refused for, and the
    ``id`` and ``seq`` it carried (``None`` where they could not be read)."""

    def __init__(
        self,
        error: SpillwayError,
        frame_id: str | None = None,
        seq: int | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(error.message)
        self.error = error
        self.frame_id = frame_id
        self.seq = seq
        self.extra = extra

    def answer(self) -> Answer:
        """The refusal's answer."""
        return Answer.failed(self.error, self.frame_id, self.seq, **self.extra)


@dataclass(frozen=True)
class Frame:
    """A frame whose envelope was read: the request itself is checked by ``routed``."""

    id: str
    seq: int | None
    action: str
    header: dict[str, Any]
    """The JSON object as sent (envelope fields included)."""


def frame_bytes(body: object, base64_encoded: bool, limit: int) -> bytes:
    """The text frame as received (its UTF-8 encoding), within ``limit`` bytes. An event
    marked ``isBase64Encoded`` would be a binary frame, which API Gateway closes the
    connection on and never hands over: it is refused, its body not decoded."""
    if not isinstance(body, str):
        raise RefusedFrame(InvalidFrameError("a frame must have a body"))
    if base64_encoded:
        raise RefusedFrame(
            InvalidFrameError(
                "binary frames are not accepted (API Gateway's WebSocket APIs take text "
                'frames only): send binary inputs as BYTES with "content_type": "base64"'
            )
        )
    if len(body) > limit:
        raise RefusedFrame(too_large(len(body), limit))
    try:
        data = body.encode("utf-8")
    except UnicodeEncodeError:
        raise RefusedFrame(InvalidFrameError("a text frame must be UTF-8")) from None
    if len(data) > limit:
        raise RefusedFrame(too_large(len(data), limit))
    return data


def too_large(size: int, limit: int, what: str = "frame") -> MessageTooLargeError:
    """The 413 of a frame (or an answer) over the message limit."""
    return MessageTooLargeError(
        f"{what} of {size} bytes exceeds the WebSocket message limit of {limit} bytes; "
        "send larger inputs through the REST API"
    )


def read_frame(data: bytes) -> Frame:
    """The frame's envelope, checked; ``RefusedFrame`` when it cannot be read."""
    try:
        header = load_json_object(data)
    except InvalidInputError as exc:
        raise RefusedFrame(InvalidFrameError(exc.message)) from None
    frame_id = _frame_id(header.get("id"))
    seq = _seq(header.get("seq"), frame_id)
    action = header.get("action", "infer")
    if action not in ACTIONS:
        raise RefusedFrame(
            InvalidFrameError(f"action must be one of {', '.join(ACTIONS)}"), frame_id, seq
        )
    return Frame(frame_id, seq, str(action), header)


def _frame_id(value: object) -> str:
    if isinstance(value, str) and FRAME_ID.fullmatch(value):
        return value
    raise RefusedFrame(
        InvalidFrameError("a frame needs an id of 1-128 letters, digits or ._:-"), None, None
    )


def _seq(value: object, frame_id: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEQ:
        raise RefusedFrame(
            InvalidFrameError(f"seq must be an integer from 0 to {MAX_SEQ}"), frame_id
        )
    return value


def routed(
    frame: Frame, request_id: str, remaining_ms: float | None, tenant: str | None
) -> tuple[Call, Target]:
    """The router's call and target for an infer frame: the model path validated as the
    REST API validates it, the tenant the connection's (never one the frame names)."""
    target = require_model_target(_model_path(frame.header))
    request = {k: v for k, v in frame.header.items() if k not in _ENVELOPE}
    _answers_as_json(request)
    headers = {"content-type": JSON_CONTENT_TYPE}
    call = Call("POST", headers, json_bytes(request), request_id, remaining_ms, tenant)
    return call, target


def _model_path(header: dict[str, Any]) -> str:
    model = header.get("model")
    if model is None:
        raise InvalidInputError('a frame needs a "model"')
    path = f"/v2/models/{validate_model_name(model)}"
    version = header.get("version")
    if version is not None:
        if isinstance(version, bool) or not isinstance(version, str | int):
            raise InvalidInputError("version must be a string")
        path += f"/versions/{validate_version(version)}"
    return path + "/infer"


def _answers_as_json(request: dict[str, Any]) -> None:
    """Drop what would make the answer binary (answers are text frames) and a tenant the
    request names (the connection's tenant is the only one)."""
    parameters = request.get("parameters")
    if isinstance(parameters, dict):
        kept = {k: v for k, v in parameters.items() if k not in ("tenant", "binary_data_output")}
        request["parameters"] = kept
    outputs = request.get("outputs")
    if isinstance(outputs, list):
        request["outputs"] = [_json_output(output) for output in outputs]


def _json_output(output: object) -> object:
    if not isinstance(output, dict) or not isinstance(output.get("parameters"), dict):
        return output
    parameters = {k: v for k, v in output["parameters"].items() if k != "binary_data"}
    return {**output, "parameters": parameters}


@dataclass(frozen=True)
class Answer:
    """What is pushed for one frame, and what it counts for."""

    body: dict[str, Any]
    ok: bool
    cost_usd: float = 0.0
    backend: str | None = None

    @property
    def data(self) -> bytes:
        """The answer as the text frame pushed."""
        return json.dumps(self.body, separators=(",", ":")).encode()

    @property
    def code(self) -> str | None:
        """A failure's stable code."""
        code = self.body.get("code")
        return code if isinstance(code, str) and not self.ok else None

    @classmethod
    def failed(
        cls, error: SpillwayError, frame_id: str | None, seq: int | None = None, **extra: Any
    ) -> Answer:
        """``{"id", "seq"?, "error", "code", "status", **extra}``."""
        return cls(_failure(frame_id, seq, error.message, error.code, error.status, extra), False)

    @classmethod
    def of_reply(cls, frame: Frame, reply: Reply) -> Answer:
        """The router's reply as a frame's answer: the V2 response with ``id``, ``seq``
        and ``spillway`` (from the reply's ``x-spillway-*`` headers), or a failure with
        the router's own code and status."""
        cost = _cost(reply.header("x-spillway-cost-usd"))
        backend = reply.header("x-spillway-backend")
        backend = None if backend in (None, "none") else backend
        document = _json_document(reply.body)
        if 200 <= reply.status < 300 and document is not None:
            spillway = {
                "backend": backend,
                "rule": reply.header("x-spillway-rule"),
                "cost_usd": cost,
                "fallback": reply.header("x-spillway-fallback"),
            }
            body = {**document, "id": frame.id, **_seq_field(frame.seq), "spillway": spillway}
            return cls(body, True, cost, backend)
        error = (document or {}).get("error")
        code = (document or {}).get("code")
        failure = _failure(
            frame.id,
            frame.seq,
            error if isinstance(error, str) else f"the router answered {reply.status}",
            code if isinstance(code, str) else "internal",
            reply.status if reply.status >= 400 else 500,
            {},
        )
        return cls(failure, False, cost, backend)


def _failure(
    frame_id: str | None,
    seq: int | None,
    message: str,
    code: str,
    status: int,
    extra: dict[str, Any],
) -> dict[str, Any]:
    body = {"id": frame_id, **_seq_field(seq), "error": message, "code": code, "status": status}
    return {**body, **extra}


def _seq_field(seq: int | None) -> dict[str, int]:
    return {} if seq is None else {"seq": seq}


def _cost(value: str | None) -> float:
    try:
        return float(value) if value is not None else 0.0
    except ValueError:
        return 0.0


def _json_document(body: bytes) -> dict[str, Any] | None:
    try:
        return load_json_object(body)
    except InvalidInputError:
        return None
