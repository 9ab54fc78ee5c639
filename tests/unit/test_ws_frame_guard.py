"""``FrameGuard`` reads each WebSocket frame's header off the byte stream, however the
stream is cut into reads: frames within API Gateway's rules reach aiohttp's parser
unchanged, and the first binary frame (1003) or data frame over the frame limit (1009)
stops the stream at that frame's first byte, the frames before it delivered."""

from __future__ import annotations

import pytest
from aiohttp import WebSocketError

from spillway_cli.local.websocket.frames import FrameGuard
from spillway_cli.stream_drivers import _client_frame

LIMIT = 1024
TEXT, CONTINUATION, BINARY, PING = 0x1, 0x0, 0x2, 0x9


class Parser:
    def __init__(self) -> None:
        self.fed = bytearray()

    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        self.fed += data
        return False, b""

    def feed_eof(self) -> None:
        raise AssertionError("not called here")


class Queue:
    def __init__(self) -> None:
        self.errors: list[BaseException] = []

    def set_exception(self, error: BaseException) -> None:
        self.errors.append(error)


def fed_in_reads(stream: bytes, size: int) -> tuple[bytes, list[BaseException], bool]:
    """``stream`` fed ``size`` bytes a read: what the parser got, the refusals, and
    whether the guard told the connection to end."""
    parser, queue = Parser(), Queue()
    guard = FrameGuard(parser, queue, LIMIT)
    ended = False
    for start in range(0, len(stream), size):
        ended, _ = guard.feed_data(stream[start : start + size])
    return bytes(parser.fed), queue.errors, ended


ALLOWED = [
    _client_frame(b"x" * 10, TEXT, True),
    _client_frame(b"", PING, True),
    _client_frame(b"y" * LIMIT, TEXT, False),  # a message spanning frames at the limit
    _client_frame(b"z" * 200, CONTINUATION, True),
]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 1000, 100_000])
def test_frames_within_the_rules_reach_the_parser_unchanged(size: int) -> None:
    stream = b"".join(ALLOWED)
    assert fed_in_reads(stream, size) == (stream, [], False)


@pytest.mark.parametrize("size", [1, 5, 131, 100_000])
@pytest.mark.parametrize(
    ("refused", "code"),
    [
        (_client_frame(b"\x00\x01", BINARY, True), 1003),
        (_client_frame(b"w" * (LIMIT + 1), TEXT, True), 1009),
        (_client_frame(b"w" * (LIMIT + 1), CONTINUATION, True), 1009),
        (_client_frame(b"w" * 70_000, TEXT, True), 1009),  # a 64-bit length
    ],
    ids=["binary", "text", "continuation", "long"],
)
def test_the_first_refused_frame_stops_the_stream_at_its_first_byte(
    size: int, refused: bytes, code: int
) -> None:
    before = b"".join(ALLOWED)
    after = _client_frame(b"never", TEXT, True)
    fed, errors, ended = fed_in_reads(before + refused + after, size)
    # THEN the frames before it were delivered, nothing of it or after it
    assert fed == before
    (error,) = errors
    assert isinstance(error, WebSocketError)
    assert error.code == code
    assert ended
