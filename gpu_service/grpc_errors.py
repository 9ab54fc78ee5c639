"""How a gRPC call ends: a ``SpillwayError`` as a gRPC status, once for every RPC.

A ``SpillwayError`` ends an RPC with the gRPC status of its HTTP status (``STATUS_CODES``;
anything else is ``INTERNAL``, logged with its traceback), the message ``<code>:
<message>`` and the code also in the trailing metadata ``spillway-code``; a call past one
of the door's limits (``GrpcLimitError``) is ``RESOURCE_EXHAUSTED``. ``unary_rpc`` serves a
unary RPC as a client-streaming one, counted in the peer's slots from its start (the
limits are ``gpu_service.grpc_limits``'s), and counts every call by method and status
(``gpu_service.metrics.RpcCounts``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import wraps
from typing import Any, Protocol, TypeVar

import grpc

from gpu_service.dataplane import DataPlane
from gpu_service.grpc_limits import PeerSlots, first_message, peer_key
from gpu_service.metrics import GRPC
from spillway.protocol.errors import GrpcLimitError, SpillwayError

log = logging.getLogger("spillway.grpc")

STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    405: grpc.StatusCode.UNIMPLEMENTED,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    409: grpc.StatusCode.ABORTED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
"""A ``SpillwayError``'s HTTP status as a gRPC status (any other: ``INTERNAL``). 413 is
``RESOURCE_EXHAUSTED``, as gRPC itself answers a message over the size limit; 429 and 503
are ``UNAVAILABLE``, the status gRPC clients retry."""
LIMIT_STATUS = grpc.StatusCode.RESOURCE_EXHAUSTED
"""A ``GrpcLimitError``'s status (a call past one of the door's limits, 429), whatever
``STATUS_CODES`` says of 429: gRPC answers its own limits so."""

Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Any]])


class Servicer(Protocol):
    """What ``unary_rpc`` reads of the servicer whose RPC it serves
    (``grpc_server.InferenceService``)."""

    plane: DataPlane
    slots: PeerSlots


def unary_rpc(handler: Handler) -> Handler:
    """A unary RPC served as a client-streaming one: counted in the peer's slots from its
    start, its one message read within ``GPU_BODY_TIMEOUT_S``, then ``handler``. End the
    RPC with the gRPC status of a ``SpillwayError`` (``INTERNAL`` for anything else,
    logged with its traceback); count it by method and status either way."""
    method = handler.__name__

    @wraps(handler)
    async def wrapper(self: Servicer, requests: Any, context: Any) -> Any:
        peer = peer_key(context.peer())
        try:
            self.slots.take(peer)
        except SpillwayError as error:
            return await abort_rpc(context, method, error)
        try:
            request = await first_message(requests, self.plane.settings.body_timeout_s)
            response = await handler(self, request, context)
        except Exception as error:  # noqa: BLE001 - every error becomes a status
            return await abort_rpc(context, method, error)
        finally:
            self.slots.give(peer)
        GRPC.calls[method, "OK"] += 1
        return response

    return wrapper  # type: ignore[return-value]


def status_of(error: BaseException) -> grpc.StatusCode:
    """The gRPC status that ends a call failed with ``error``."""
    if isinstance(error, GrpcLimitError):
        return LIMIT_STATUS
    if isinstance(error, SpillwayError):
        return STATUS_CODES.get(error.status, grpc.StatusCode.INTERNAL)
    return grpc.StatusCode.INTERNAL


async def abort_rpc(context: Any, method: str, error: Exception) -> None:
    """End the RPC with ``error``'s status, counted; never returns."""
    status = status_of(error)
    GRPC.calls[method, status.name] += 1
    if isinstance(error, SpillwayError):
        log.info("refused %s: %s", method, error.message)
        await context.abort(
            status, details(error), trailing_metadata=(("spillway-code", error.code),)
        )
    log.error("%s failed", method, exc_info=error)
    await context.abort(status, "internal: internal server error")


def details(error: SpillwayError) -> str:
    """An error's text for the client: ``<code>: <message>``."""
    return f"{error.code}: {error.message}"
