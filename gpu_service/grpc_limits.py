"""The gRPC door's limits: what the HTTP server bounds per connection, in gRPC's terms.

- **Slots.** One connection carries at most ``grpc_max_streams_per_connection`` calls
  (HTTP/2 ``SETTINGS_MAX_CONCURRENT_STREAMS``); one peer address at most
  ``grpc_max_rpcs_per_peer`` over all its connections, and all peers together at most
  ``grpc_max_rpcs`` (``PeerSlots``). A call past them is refused at once with
  ``RESOURCE_EXHAUSTED`` and the code ``too_many_rpcs``, so a few peers can never take
  every slot. Every call of ``GRPCInferenceService`` is counted from its start, before its
  message is read (the unary RPCs are served as client-streaming ones that read exactly
  one message, ``grpc_errors.unary_rpc``), and its message must arrive within
  ``body_timeout_s``.
- **Messages.** A message is parsed by ``parser``: bytes that are not the RPC's message
  become ``Malformed``, which the RPC answers with ``INVALID_ARGUMENT`` and the code
  ``malformed_message`` (gRPC's own handling would answer ``UNKNOWN`` with the
  parser's class name).
- **Streams** (``pump``). A stream runs up to ``grpc_stream_window`` requests at once and
  reads no more while that many are running or answered but unsent. With nothing in
  flight, a stream that receives nothing for ``grpc_stream_idle_s`` ends with
  ``DEADLINE_EXCEEDED`` (``idle_timeout``). An answer the client's flow control does not
  take within ``write_timeout_s`` ends the stream: nothing more of it is read or
  computed, and its status, ``RESOURCE_EXHAUSTED`` (``unread_answers``), follows the
  answers already sent. (HTTP/2 sends that status after those answers; a client that
  never reads them never sees it, and its connection is closed at
  ``grpc_max_connection_age_s`` plus the grace: grpc.aio gives a server no way to reset
  one stream.)
"""

from __future__ import annotations

import asyncio
import ctypes
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from gpu_service.settings import GpuSettings
from spillway.protocol.errors import (
    IdleTimeoutError,
    InvalidInputError,
    MalformedMessageError,
    RequestTimeoutError,
    TooManyRpcsError,
    UnreadAnswersError,
)

_KEEPALIVE_MIN_PING_MS = 5 * 60 * 1000
"""A client may ping at most this often while no data flows; a third ping sooner ends its
connection (``GOAWAY too_many_pings``): grpc-go's ``EnforcementPolicy.MinTime`` and
gRPC core's defaults, stated so they cannot drift."""
_KEEPALIVE_PING_STRIKES = 2
"""Pings past ``_KEEPALIVE_MIN_PING_MS`` a client may send before its connection ends."""


@dataclass(frozen=True)
class Malformed:
    """What ``parser`` gives for bytes that are not the message: the error to answer."""

    error: MalformedMessageError


def parser(message_class: Any) -> Callable[[bytes], Any]:
    """A request deserializer for ``message_class`` that gives ``Malformed`` instead of
    raising, so the RPC answers it itself."""
    name = message_class.DESCRIPTOR.full_name

    def parse(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except DecodeError:
            return Malformed(MalformedMessageError(f"the message is not a valid {name} (protobuf)"))

    return parse


def checked(request: Any) -> Any:
    """``request``, or its error raised when it is ``Malformed``."""
    if isinstance(request, Malformed):
        raise request.error
    return request


def peer_key(peer: str) -> str:
    """The address of a gRPC peer (``ipv4:10.0.0.7:51234`` → ``10.0.0.7``,
    ``ipv6:[::1]:51234`` → ``::1``): every connection from one address counts as one
    peer. Behind a load balancer that is the balancer's node."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6" and rest.startswith("["):
        return rest[1 : rest.find("]")]
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    return peer


class PeerSlots:
    """Calls open per peer address and in all, each under its limit. Event loop only."""

    def __init__(self, per_peer: int, total: int) -> None:
        self.per_peer = per_peer
        self.total = total
        self.open: Counter[str] = Counter()
        self.in_use = 0

    def take(self, peer: str) -> None:
        """Count a call of ``peer``; refused (``TooManyRpcsError``) past a limit."""
        if self.open[peer] >= self.per_peer:
            raise TooManyRpcsError(
                f"this peer already has {self.per_peer} gRPC calls open; "
                "finish some before opening more"
            )
        if self.in_use >= self.total:
            raise TooManyRpcsError("the service has as many gRPC calls open as it takes")
        self.open[peer] += 1
        self.in_use += 1

    def give(self, peer: str) -> None:
        """Uncount a call of ``peer`` taken with ``take``."""
        self.in_use -= 1
        self.open[peer] -= 1
        if self.open[peer] <= 0:
            del self.open[peer]


async def first_message(requests: AsyncIterator[Any], timeout_s: float) -> Any:
    """The one message of a unary call, which must arrive within ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            return checked(await anext(requests))
    except TimeoutError:
        raise RequestTimeoutError(
            f"the request message did not arrive within {timeout_s:g} s"
        ) from None
    except StopAsyncIteration:
        raise InvalidInputError("the call ended without its request message") from None


Answer = Callable[[Any], Awaitable[Any]]
"""Answers one request of a stream (never raises: an error becomes its answer)."""


async def pump(
    requests: AsyncIterator[Any],
    write: Callable[[Any], Awaitable[None]],
    answer: Answer,
    settings: GpuSettings,
) -> None:
    """Answer a stream's requests in their order, up to ``grpc_stream_window`` at once;
    returns when the client has closed its side and every answer is written. Raises
    ``IdleTimeoutError`` or ``UnreadAnswersError`` at those limits (the requests still
    in flight are cancelled)."""
    window: asyncio.Queue[asyncio.Task[Any] | BaseException | None] = asyncio.Queue(
        settings.grpc_stream_window
    )
    idle = _IdleClock(settings.grpc_stream_idle_s)
    reader = asyncio.ensure_future(_read(requests, window, answer, idle))
    try:
        while (item := await window.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            response = await item
            try:
                async with asyncio.timeout(settings.write_timeout_s):
                    await write(response)
            except TimeoutError:
                raise UnreadAnswersError(
                    f"the client took no answer for {settings.write_timeout_s:g} s; "
                    "read the stream's answers as they come"
                ) from None
            if window.empty():
                idle.start()
        await reader
    finally:
        reader.cancel()
        while not window.empty():
            if isinstance(item := window.get_nowait(), asyncio.Task):
                item.cancel()


class _IdleClock:
    """The idle limit of a stream's reader: running while nothing is in flight."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.timeout: asyncio.Timeout | None = None

    def start(self) -> None:
        if self.timeout is not None and self.timeout.when() is None:
            self.timeout.reschedule(asyncio.get_running_loop().time() + self.limit_s)

    def stop(self) -> None:
        if self.timeout is not None:
            self.timeout.reschedule(None)


async def _read(
    requests: AsyncIterator[Any],
    window: asyncio.Queue[asyncio.Task[Any] | BaseException | None],
    answer: Answer,
    idle: _IdleClock,
) -> None:
    """Start each request's answer in the window; then put what ended the reading: None
    when the client closed its side, else the error (the idle limit, a broken call)."""
    end: BaseException | None = None
    try:
        async with asyncio.timeout(None) as timeout:
            idle.timeout = timeout
            idle.start()
            async for request in requests:
                idle.stop()
                await window.put(asyncio.ensure_future(answer(request)))
    except TimeoutError:
        end = IdleTimeoutError(
            f"the stream sent no request for {idle.limit_s:g} s with nothing in flight"
        )
    except Exception as error:  # noqa: BLE001 - the writer raises it
        end = error
    finally:
        idle.timeout = None
    await window.put(end)


def server_options(settings: GpuSettings) -> list[tuple[str, int]]:
    """The gRPC core options for these settings: message size, streams per connection,
    connection age, and keep-alive enforcement (grpc-go's defaults, stated)."""
    options = [
        ("grpc.max_receive_message_length", settings.grpc_max_message_bytes),
        ("grpc.max_send_message_length", -1),
        ("grpc.max_concurrent_streams", settings.grpc_max_streams_per_connection),
        ("grpc.http2.min_ping_interval_without_data_ms", _KEEPALIVE_MIN_PING_MS),
        ("grpc.http2.max_ping_strikes", _KEEPALIVE_PING_STRIKES),
        # The service's own keep-alive pings go on while no data flows, so a silent
        # peer is found however long its connection has been quiet.
        ("grpc.http2.max_pings_without_data", 0),
    ]
    if settings.grpc_max_connection_age_s is not None:
        options += [
            ("grpc.max_connection_age_ms", int(settings.grpc_max_connection_age_s * 1000)),
            (
                "grpc.max_connection_age_grace_ms",
                int(settings.grpc_max_connection_age_grace_s * 1000),
            ),
        ]
    return options


_TRIM_BYTES = 1024 * 1024
"""Messages from this size on leave memory to give back once they are done."""
_TRIM_DELAY_S = 1.0
"""How long after the last big message a trim waits (the call's buffers go with it)."""


class MemoryReturn:
    """Gives the C heap's free memory back to the system (glibc's ``malloc_trim``) once
    no big message is in flight. Big messages are read and parsed on gRPC's and the
    parse threads; glibc keeps what they freed in those threads' arenas (its ``mmap``
    threshold rises to 32 MiB after the first big free), so without a trim the service's
    RSS stays at its peak. Elsewhere than glibc, nothing happens. Event loop only."""

    def __init__(self) -> None:
        self.big = 0
        self._pending: asyncio.TimerHandle | None = None
        self._trim = _malloc_trim()

    def hold(self, size: int) -> bool:
        """Note a message of ``size`` bytes; whether ``release`` must be called."""
        if size < _TRIM_BYTES or self._trim is None:
            return False
        self.big += 1
        return True

    def release(self) -> None:
        """A big message is done; trim shortly after the last one."""
        self.big -= 1
        if self.big == 0 and self._pending is None:
            self._pending = asyncio.get_running_loop().call_later(_TRIM_DELAY_S, self._start)

    def _start(self) -> None:
        self._pending = None
        if self.big == 0 and self._trim is not None:
            # A trim of a big heap takes milliseconds: off the event loop.
            asyncio.get_running_loop().run_in_executor(None, self._trim, 0)


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)
    return None if trim is None else trim
