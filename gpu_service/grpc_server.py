"""The KServe V2 gRPC service (``GRPCInferenceService``) on the service's event loop.

The RPCs are those ``tritonclient.grpc`` uses: health, server and model metadata,
``ModelInfer`` (typed contents or ``raw_input_contents``; outputs always come back as
``raw_output_contents``), ``ModelStreamInfer``, and Triton's ``ModelConfig``,
``ModelStatistics`` and repository index/load/unload. The messages are the generated ones
``tritonclient`` ships (``tritonclient.grpc.service_pb2``, Triton's ``grpc_service.proto``).

Each RPC is one of the data plane's operations, as the HTTP routes are: the same
registry and batchers, limits, statistics and metrics. An infer request is converted
once (``gpu_service.grpc_messages``): its message becomes the core's decoded request
(``spillway.inference.Decoded``, the arrays read straight from the raw contents), and its
outputs are asked for as binary data, whose bytes after the encoded response's JSON
header are the raw output contents as they are. A ``SpillwayError`` ends an RPC with the
gRPC status of its HTTP status (``STATUS_CODES``; anything else is ``INTERNAL``), the
message ``<code>: <message>`` and the code also in the trailing metadata
``spillway-code`` (``gpu_service.grpc_errors``). A stream answers each request in its
order, a failed one with ``error_message`` (as Triton does), and runs up to
``GPU_GRPC_STREAM_WINDOW`` of them at once so they can share batches.

The door's limits (slots per connection, per peer and in all; a unary call's message
time; a stream's idle and unread limits; malformed messages) are
``gpu_service.grpc_limits``'s. Messages are limited to ``GPU_GRPC_MAX_MESSAGE_BYTES``
(bigger: ``RESOURCE_EXHAUSTED``) and held in the same body budget as HTTP bodies.

While the service drains, readiness is false and new infer requests get ``UNAVAILABLE``
(a new stream too; on an open stream, a request read after the drain began is answered
with ``unavailable: ...``); the server stops after the RPCs in flight finish.
``grpc.health.v1.Health`` answers for the whole server (``""``) and for
``inference.GRPCInferenceService``: ``SERVING`` exactly when HTTP's ``/v2/health/ready``
is true (the load balancer's health check). Every call is counted by method and status,
and stream messages by direction, in ``/metrics`` (``gpu_service.metrics.RpcCounts``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from gpu_service.dataplane import DataPlane
from gpu_service.grpc_errors import abort_rpc, details, status_of, unary_rpc
from gpu_service.grpc_limits import (
    MemoryReturn,
    PeerSlots,
    checked,
    parser,
    peer_key,
    pump,
    server_options,
)
from gpu_service.grpc_messages import decode_request, encode_response, parsed
from gpu_service.metrics import GRPC
from gpu_service.served import InferResult
from gpu_service.settings import GpuSettings
from spillway import tracing
from spillway.protocol.errors import SpillwayError, UnavailableError

log = logging.getLogger("spillway.grpc")

HEALTH_SERVICES = ("", "inference.GRPCInferenceService")
"""The names ``grpc.health.v1.Health`` answers for: the whole server and the inference
service."""

_HEALTH_REFRESH_S = 1.0
"""How often ``Health.Watch`` subscribers are told a changed status (``Check`` reads it
at once)."""


def _metadata(context: Any, key: str) -> str | None:
    for name, value in context.invocation_metadata() or ():
        if name == key:
            return str(value)
    return None


def _trace(context: Any) -> dict[str, str]:
    """The call's W3C trace context, from the ``traceparent``/``tracestate`` metadata."""
    return tracing.carrier_of({key: _metadata(context, key) for key in tracing.CARRIER_KEYS})


class InferenceService(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """``GRPCInferenceService`` over the data plane (the methods are the RPCs' names)."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane
        settings = plane.settings
        self.slots = PeerSlots(settings.grpc_max_rpcs_per_peer, settings.grpc_max_rpcs)
        self.memory = MemoryReturn()

    @unary_rpc
    async def ServerLive(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerLiveResponse(live=True)

    @unary_rpc
    async def ServerReady(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerReadyResponse(ready=self.plane.ready())

    @unary_rpc
    async def ModelReady(self, request: Any, context: Any) -> Any:
        await self.plane.found(request.name)
        ready = self.plane.model_ready(request.name, request.version or None)
        return service_pb2.ModelReadyResponse(ready=ready)

    @unary_rpc
    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        return parsed(self.plane.server_metadata(), service_pb2.ServerMetadataResponse())

    @unary_rpc
    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        await self.plane.found(request.name)
        metadata = self.plane.model_metadata(request.name, request.version or None)
        return parsed(metadata, service_pb2.ModelMetadataResponse())

    @unary_rpc
    async def ModelConfig(self, request: Any, context: Any) -> Any:
        await self.plane.found(request.name)
        config = self.plane.model_config(request.name, request.version or None)
        return service_pb2.ModelConfigResponse(
            config=parsed(config, model_config_pb2.ModelConfig())
        )

    @unary_rpc
    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        if request.name:
            await self.plane.found(request.name)
        stats = self.plane.model_stats(request.name or None, request.version or None)
        return parsed(stats, service_pb2.ModelStatisticsResponse())

    @unary_rpc
    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        self.plane.authorize(_metadata(context, "authorization"))
        index = await self.plane.repository_index()
        return parsed({"models": index}, service_pb2.RepositoryIndexResponse())

    @unary_rpc
    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        self.plane.authorize(_metadata(context, "authorization"))
        await self.plane.load(request.model_name)
        return service_pb2.RepositoryModelLoadResponse()

    @unary_rpc
    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        self.plane.authorize(_metadata(context, "authorization"))
        await self.plane.unload(request.model_name)
        return service_pb2.RepositoryModelUnloadResponse()

    @unary_rpc
    async def ModelInfer(self, request: Any, context: Any) -> Any:
        with tracing.carry(_trace(context)):
            return await self._infer(request, _metadata(context, "x-spillway-tenant-scope"))

    async def ModelStreamInfer(self, requests: AsyncIterator[Any], context: Any) -> None:
        """Each request answered in its order (``grpc_limits.pump``: a window of requests
        at once, the idle and unread limits). A stream past the peer's slots, or opened
        while the service drains, is refused."""
        method = "ModelStreamInfer"
        peer = peer_key(context.peer())
        try:
            self.slots.take(peer)
        except SpillwayError as error:
            return await abort_rpc(context, method, error)
        status: str | None = grpc.StatusCode.CANCELLED.name  # unless it ends below
        try:
            if self.plane.draining:
                raise UnavailableError("the service is shutting down")
            scope = _metadata(context, "x-spillway-tenant-scope")
            answer = partial(self._stream_one, scope=scope)
            with tracing.carry(_trace(context)):  # every message of the stream in its trace
                await pump(requests, context.write, answer, self.plane.settings)
            status = grpc.StatusCode.OK.name
        except Exception as error:  # noqa: BLE001 - every error becomes a status
            status = None  # counted by abort_rpc
            await abort_rpc(context, method, error)
        finally:
            self.slots.give(peer)
            if status is not None:
                GRPC.calls[method, status] += 1

    async def _stream_one(self, request: Any, scope: str | None) -> Any:
        GRPC.stream_in += 1
        try:
            response = await self._infer(checked(request), scope)
        except Exception as error:
            GRPC.stream_out[status_of(error).name] += 1
            if isinstance(error, SpillwayError):
                return service_pb2.ModelStreamInferResponse(error_message=details(error))
            log.error("a stream's request failed", exc_info=error)
            return service_pb2.ModelStreamInferResponse(
                error_message="internal: internal server error"
            )
        GRPC.stream_out["OK"] += 1
        return service_pb2.ModelStreamInferResponse(infer_response=response)

    async def _infer(self, request: Any, scope: str | None) -> Any:
        arrived = time.perf_counter()
        size = request.ByteSize()
        big = self.memory.hold(size)
        try:
            result = await self._infer_held(request, scope, arrived, size)
        finally:
            if big:
                self.memory.release()
        return encode_response(result.body, result.header_length)

    async def _infer_held(
        self, request: Any, scope: str | None, arrived: float, size: int
    ) -> InferResult:
        plane = self.plane
        plane.check_infer(request.model_name)
        plane.bodies.charge(size)
        try:
            decoded = decode_request(request)
            return await plane.infer_decoded(
                request.model_name,
                request.model_version or None,
                decoded,
                arrived=arrived,
                size=size,
                tenant_scope=scope,
            )
        finally:
            plane.bodies.release(size)


class Health(health.aio.HealthServicer):  # type: ignore[misc]
    """``grpc.health.v1.Health`` for ``HEALTH_SERVICES``: ``SERVING`` while the data plane
    is ready (``DataPlane.ready``, the rule of ``/v2/health/ready``: not draining, the
    start-up models loaded, room in the body budget), else ``NOT_SERVING``. ``Check``
    reads the data plane on each call; ``Watch`` subscribers hear of a change within
    ``_HEALTH_REFRESH_S``."""

    def __init__(self, plane: DataPlane) -> None:
        super().__init__()
        self.plane = plane

    async def refresh(self) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        status = serving if self.plane.ready() else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in HEALTH_SERVICES:
            if self._server_status.get(service) != status:
                await self.set(service, status)

    async def Check(self, request: Any, context: Any) -> Any:
        await self.refresh()
        return await super().Check(request, context)

    async def watch_plane(self) -> None:
        """Keep the statuses current for ``Watch`` (until cancelled)."""
        while True:
            await self.refresh()
            await asyncio.sleep(_HEALTH_REFRESH_S)


_SERVICE = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]


def inference_handlers(service: InferenceService) -> grpc.GenericRpcHandler:
    """``GRPCInferenceService``'s RPCs that ``service`` implements (the others are gRPC's
    ``UNIMPLEMENTED``), each parsing its message with ``grpc_limits.parser``; the unary
    ones served as client-streaming (``grpc_errors.unary_rpc``), so they count from their start."""
    handlers = {}
    for method in _SERVICE.methods:
        own = getattr(InferenceService, method.name, None)
        if own is None or own is getattr(
            service_pb2_grpc.GRPCInferenceServiceServicer, method.name, None
        ):
            continue
        parse = parser(getattr(service_pb2, method.input_type.name))
        behaviour = getattr(service, method.name)
        if method.server_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                behaviour, request_deserializer=parse, response_serializer=_serialize
            )
        else:
            handlers[method.name] = grpc.stream_unary_rpc_method_handler(
                behaviour, request_deserializer=parse, response_serializer=_serialize
            )
    return grpc.method_handlers_generic_handler(_SERVICE.full_name, handlers)


def _serialize(message: Any) -> bytes:
    return bytes(message.SerializeToString())


def time_limits(settings: GpuSettings) -> list[tuple[str, int]]:
    """The HTTP side's time limits on a client, in gRPC's terms: a connection with no RPC
    for ``GPU_KEEP_ALIVE_S`` is closed; a peer that stops answering keep-alive pings for
    ``GPU_WRITE_TIMEOUT_S`` is dropped (with its streams: a client whose transport stops
    reading cannot hold a connection open; a stream's own limits are ``grpc_limits``'s);
    one connection carries at most ``GPU_GRPC_MAX_STREAMS_PER_CONNECTION`` RPCs at
    once."""
    return [
        ("grpc.max_connection_idle_ms", int(settings.keep_alive_s * 1000)),
        ("grpc.keepalive_time_ms", int(settings.header_timeout_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(settings.write_timeout_s * 1000)),
        ("grpc.max_concurrent_streams", settings.grpc_max_streams_per_connection),
    ]


@dataclass(frozen=True)
class GrpcServer:
    """The running gRPC server, the port it listens on and its health service."""

    server: grpc.aio.Server
    port: int
    health: Health
    watcher: asyncio.Task[None]

    @classmethod
    async def start(cls, plane: DataPlane) -> GrpcServer:
        """Serve ``GRPCInferenceService`` on the settings' host and gRPC port."""
        settings = plane.settings
        # No maximum_concurrent_rpcs: its refusal has no code and counts every peer's
        # calls together, so a few peers could take all of it (PeerSlots counts instead).
        server = grpc.aio.server(
            options=[("grpc.so_reuseport", 0), *time_limits(settings), *server_options(settings)]
        )
        server.add_generic_rpc_handlers((inference_handlers(InferenceService(plane)),))
        health_service = Health(plane)
        health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
        host = f"[{settings.host}]" if ":" in settings.host else settings.host
        port = server.add_insecure_port(f"{host}:{settings.grpc_port or 0}")
        await server.start()
        log.info("listening on grpc://%s:%s", settings.host, port)
        return cls(
            server, port, health_service, asyncio.ensure_future(health_service.watch_plane())
        )

    async def stop(self, grace_s: float) -> None:
        """Health says ``NOT_SERVING`` for good; new RPCs are refused; those in flight get
        up to ``grace_s`` to finish."""
        self.watcher.cancel()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
