"""API Gateway's frame rules on aiohttp's WebSocket parser, read off each frame's header
before its payload, with no invocation for a refused frame:

- a binary frame closes the connection with 1003: WebSocket APIs take text frames only
  (https://docs.aws.amazon.com/apigateway/latest/developerguide/websocket-api-develop-binary-media-types.html);
- a frame over 32 KiB closes it with 1009 (the quota:
  https://docs.aws.amazon.com/apigateway/latest/developerguide/apigateway-execution-service-websocket-limits-table.html;
  ``spillway.aws.limits``), as does a message (all its frames) over 128 KiB, which
  aiohttp's own message limit refuses (``GuardedResponse``'s ``max_msg_size``). A message
  over 32 KiB must span frames (a client sends it fragmented); permessage-deflate is not
  negotiated, so a frame's size is what it carries.
"""

from __future__ import annotations

from typing import Any

from aiohttp import WebSocketError, WSMsgType, web
from aiohttp.web_request import BaseRequest

from spillway.aws.limits import WS_CLOSE_MESSAGE_TOO_BIG, WS_CLOSE_UNSUPPORTED_DATA


class FrameGuard:
    """aiohttp's WebSocket parser behind API Gateway's frame rules, read off each frame's
    header before its payload: a binary frame ends the connection with 1003, a data frame
    over ``frame_limit`` bytes with 1009 (the module's docstring has the pages). The
    frames before the refused one are still delivered, none of its bytes; the refusal
    reaches ``receive`` after them as the ``WebSocketError`` aiohttp raises for its own
    limits, and aiohttp closes the connection with its code."""

    def __init__(self, parser: Any, queue: Any, frame_limit: int) -> None:
        self._parser, self._queue, self._limit = parser, queue, frame_limit
        self._pending = b""
        """The start of a frame header whose end has not arrived: held back."""
        self._skip = 0
        """Payload bytes of the current frame still to pass."""
        self._refused = False

    def feed_data(self, data: bytes | bytearray | memoryview) -> tuple[bool, bytes]:
        if self._refused:
            return True, b""
        stream = self._pending + bytes(data) if self._pending else data
        end, refusal = self._scan(stream)
        result: tuple[bool, bytes] = (False, b"")
        if end:
            result = self._parser.feed_data(stream if end == len(stream) else stream[:end])
        if refusal is None:
            return result
        self._refused = True
        self._queue.set_exception(refusal)
        return True, b""

    def feed_eof(self) -> None:
        self._parser.feed_eof()

    def _scan(self, stream: bytes | bytearray | memoryview) -> tuple[int, WebSocketError | None]:
        """How much of ``stream`` may pass (up to a refused frame, or to a header not yet
        whole, which is held back), and the refusal (``None``: none)."""
        at = 0
        self._pending = b""
        while at < len(stream):
            if self._skip:
                step = min(self._skip, len(stream) - at)
                self._skip, at = self._skip - step, at + step
                continue
            head = bytes(stream[at : at + _MAX_HEADER])
            size = _header_size(head)
            if len(head) < size:
                self._pending = head
                return at, None
            refusal = self._refusal(head[0] & 0x0F, _payload_size(head))
            if refusal is not None:
                return at, refusal
            self._skip, at = _payload_size(head), at + size
        return at, None

    def _refusal(self, opcode: int, size: int) -> WebSocketError | None:
        if opcode == WSMsgType.BINARY:
            return WebSocketError(WS_CLOSE_UNSUPPORTED_DATA, "Binary frames are not supported")
        if opcode in (WSMsgType.CONTINUATION, WSMsgType.TEXT) and size > self._limit:
            return WebSocketError(
                WS_CLOSE_MESSAGE_TOO_BIG,
                f"Frame of {size} bytes exceeds the frame limit of {self._limit} bytes",
            )
        return None


_MAX_HEADER = 14
"""A frame header's longest form: 2 bytes, a 64-bit length, a 4-byte mask."""


def _header_size(head: bytes) -> int:
    """A frame header's length (RFC 6455 section 5.2), once its first two bytes are in."""
    if len(head) < 2:
        return 2
    length = head[1] & 0x7F
    extended = 2 if length == 126 else 8 if length == 127 else 0
    return 2 + extended + (4 if head[1] & 0x80 else 0)


def _payload_size(head: bytes) -> int:
    length = head[1] & 0x7F
    if length < 126:
        return length
    width = 2 if length == 126 else 8
    return int.from_bytes(head[2 : 2 + width], "big")


class GuardedResponse(web.WebSocketResponse):
    """aiohttp's WebSocket response whose parser sits behind a ``FrameGuard``."""

    def __init__(self, *, frame_limit: int, **options: Any) -> None:
        super().__init__(**options)
        self.frame_limit = frame_limit

    def _post_start(self, request: BaseRequest, protocol: str | None, writer: Any) -> None:
        super()._post_start(request, protocol, writer)
        handler = request.protocol
        # aiohttp has no hook for this: the parser it just gave the connection is wrapped
        handler._payload_parser = FrameGuard(
            handler._payload_parser,
            self._reader,
            self.frame_limit,
        )
