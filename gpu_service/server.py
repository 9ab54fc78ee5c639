"""Starting the GPU service: its own HTTP/1.1 server (``gpu_service.transport``), or the
same app as ASGI under uvicorn (``GPU_HTTP_SERVER=uvicorn``); httptools and uvloop both.

On SIGTERM (an ECS stop) readiness turns false at once and new infer requests get 503;
the server stops accepting connections, in-flight requests finish, the batchers drain
their queues, and the process exits 0 within ``drain_timeout_s``.

Under uvicorn the limits are the ones uvicorn offers (``GPU_KEEP_ALIVE_S`` as
``timeout_keep_alive``, ``GPU_MAX_CONNECTIONS`` as ``limit_concurrency``) plus what the
app sets itself: the body budget, ``GPU_BODY_TIMEOUT_S`` between two pieces of a body,
a disconnect cancelling the request's work, raw-path routing, ``HEAD`` and the ``Host``
rule. uvicorn has no time limit for a request's head (a byte a minute keeps a connection
forever), no minimum body rate, no write timeout and, with httptools, no cap on the
head's size; it answers a connection's pipelined requests one at a time, which bounds
what it holds of their answers. The service's own server has all of these.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType

import uvicorn

from gpu_service import logs, transport
from gpu_service.dataplane import DataPlane
from gpu_service.http import GpuServiceApp
from gpu_service.registry import ModelRegistry
from gpu_service.settings import GpuSettings
from spillway import tracing
from spillway.models.repository import open_repository


def build_app(settings: GpuSettings) -> GpuServiceApp:
    """The ASGI application for these settings (models load in its lifespan)."""
    registry = ModelRegistry(open_repository(settings.repository), settings)
    return GpuServiceApp(DataPlane(registry, settings))


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: GpuServiceApp) -> None:
        super().__init__(config)
        self.spillway_app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.spillway_app.plane.start_draining(f"signal {sig}")
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:
            # A drained stop is an orderly exit (status 0), not death by signal.
            self._captured_signals.remove(sig)


def serve(settings: GpuSettings) -> None:
    """Run the service until SIGTERM or SIGINT."""
    logs.configure(settings.log_level, "spillway-gpu")
    tracing.configure("spillway-gpu")  # on when an OTLP endpoint is set (OTEL_*)
    app = build_app(settings)
    if settings.http_server == "native":
        sys.exit(transport.run(app, settings))
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http="httptools",
        loop="uvloop",
        lifespan="on",
        access_log=False,
        # The service reads no client address: skip the per-request proxy-header layer.
        proxy_headers=False,
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=int(settings.drain_timeout_s),
        timeout_keep_alive=max(1, round(settings.keep_alive_s)),
        backlog=2048,
        limit_concurrency=settings.max_connections,
        log_config=None,  # keep the JSON handler configured above
    )
    _DrainingServer(config, app).run()
