"""GPU service settings: every field from a ``GPU_`` environment variable or a flag."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

import onnxruntime as ort
from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from spillway.models.engine import CPU, CUDA, EngineOptions


class GpuSettings(BaseSettings):
    """Settings of the GPU service (``GPU_<FIELD>`` in the environment)."""

    model_config = SettingsConfigDict(env_prefix="GPU_", extra="ignore")

    repository: str = "models"
    """Model repository: a folder or ``s3://bucket/prefix``."""
    host: str = "127.0.0.1"
    """Address to listen on (``0.0.0.0`` in the container)."""
    port: int = Field(default=8000, ge=0, le=65535)
    """Port to listen on."""
    grpc_port: int | None = Field(default=None, ge=0, le=65535)
    """Port of the KServe V2 gRPC service (``tritonclient.grpc``), on ``host`` beside
    HTTP; unset: no gRPC (0: a free port, logged)."""
    grpc_max_message_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    """Largest gRPC message accepted (bigger: ``RESOURCE_EXHAUSTED`` from gRPC itself,
    before the service parses it); fits an 8 MiB image (a model's default image
    ``max_bytes``) twice. gRPC's own default is 4 MiB; HTTP bodies have
    ``max_body_bytes``."""
    grpc_max_streams_per_connection: int = Field(default=100, ge=1)
    """RPCs one gRPC connection may carry at once (HTTP/2 ``SETTINGS_MAX_CONCURRENT_STREAMS``;
    Envoy's edge recommendation, 100; grpc-go's default is unlimited)."""
    grpc_max_rpcs_per_peer: int = Field(default=128, ge=1)
    """gRPC calls one peer address may have open at once, over all its connections;
    past it a new call gets ``RESOURCE_EXHAUSTED`` (``too_many_rpcs``)."""
    grpc_max_rpcs: int = Field(default=2048, ge=1)
    """gRPC calls open at once over all peers (``RESOURCE_EXHAUSTED``, ``too_many_rpcs``,
    past it); with ``grpc_max_rpcs_per_peer`` it takes 16 peers to fill."""
    grpc_stream_window: int = Field(default=64, ge=1, le=1024)
    """Requests of one ``ModelStreamInfer`` stream running, or answered and waiting to be
    sent; the stream reads no more until its oldest answer is written."""
    grpc_stream_idle_s: float = Field(default=30.0, gt=0)
    """A stream with nothing in flight that receives no request for this long ends with
    ``DEADLINE_EXCEEDED`` (``idle_timeout``); below the ALB's 60 s idle timeout, so the
    client hears why. A unary call's message must arrive within ``body_timeout_s``."""
    grpc_max_connection_age_s: float | None = Field(default=1800.0, gt=0)
    """A gRPC connection is asked to go away (``GOAWAY``) after this long and closed
    ``grpc_max_connection_age_grace_s`` later, whatever its streams do: the bound on a
    stream whose client stopped reading (unset: no bound, grpc-go's default)."""
    grpc_max_connection_age_grace_s: float = Field(default=30.0, gt=0)
    """How long the calls of a connection past its age may take to finish."""
    providers: tuple[str, ...] = (CUDA, CPU)
    """ONNX Runtime execution providers in order of preference; a CPU fallback is logged."""
    intra_op_threads: Annotated[int, Field(ge=0)] | Literal["auto"] = "auto"
    """ONNX Runtime threads of one run per slot it holds (0: ONNX Runtime's choice, one per
    core; ``auto``: see ``compute_layout``). With 1, a one-slot run computes on the
    budget's thread that runs it, so runs never outnumber the budget's slots."""
    inter_op_threads: int = Field(default=0, ge=0)
    """Threads across operators (0: ONNX Runtime decides)."""
    compute_slots: Annotated[int, Field(ge=1, le=256)] | Literal["auto"] = "auto"
    """The device's compute budget: slots that runs (and, on a CPU host, requests' CPU
    steps) hold while they compute, over every model, version and length bucket
    (``auto``: see ``compute_layout``)."""
    compute_overdraft: int = Field(default=1, ge=0, le=16)
    """Runs that may start beyond the slots while every slot is held: a short run more
    urgent than everything holding a slot, or one whose rows are ten times lighter than
    theirs (``gpu_service.compute_budget``)."""
    short_run_ms: float = Field(default=5.0, ge=0)
    """A run expected to take at most this long (by its bucket's measured time per row)
    is short: it computes at the service's own OS priority (longer runs at niceness 10)
    and, when more urgent than everything holding a slot, may overdraw the budget."""
    default_horizon_ms: float = Field(default=5000.0, gt=0)
    """The deadline the budget orders a request without one by, counted from its arrival,
    when its model declares no ``spillway.latency_budget_ms`` (the router's default
    deadline)."""
    wide_runs: bool = True
    """On a CPU host with more than one slot, a run that finds the device idle (no other
    run, step or queued request) computes on every slot's threads, on a second session
    of its model version (twice the sessions' memory): one client's request is as quick
    as on a process of its own, while concurrent ones each take one slot."""
    instance_count: Annotated[int, Field(ge=1, le=16)] | Literal["auto"] = "auto"
    """Batches of one model version and length bucket that may compute at once, within
    the budget (``auto``: as many as the budget has slots)."""
    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
    """Largest request body accepted; larger bodies get 413 before they are read."""
    max_body_bytes_in_flight: int = Field(default=128 * 1024 * 1024, ge=1024)
    """Bytes of request bodies held at once (being read or served); a request that would
    pass it gets 503 with ``Retry-After`` before its body is read."""
    max_connections: int = Field(default=1024, ge=1)
    """Concurrent connections; beyond it a connection's request gets 503."""
    keep_alive_s: float = Field(default=75.0, gt=0)
    """An idle keep-alive connection closes after this long; keep it above the load
    balancer's idle timeout (ALB: 60 s), so the balancer, not the service, closes first."""
    header_timeout_s: float = Field(default=10.0, gt=0)
    """A request's line and headers must arrive within this long of their first byte (a
    new connection's first request: of the connection's opening); else 408 and the
    connection closes (nginx's ``client_header_timeout``, 60 s there). A load balancer
    sends a head at once; only a stalling or dripping client needs longer."""
    body_timeout_s: float = Field(default=10.0, gt=0)
    """The longest wait for the next piece of a request's body (also for its first piece,
    after the headers or a ``100 Continue``); else 408 and the connection closes (nginx's
    ``client_body_timeout``, 60 s there)."""
    body_min_bytes_per_s: int = Field(default=16 * 1024, ge=1)
    """A body must also arrive at this average rate once ``body_timeout_s`` has passed
    (a body of n bytes may take ``body_timeout_s + n / rate``), so a client dripping a
    byte now and then cannot hold a connection for long (Apache's ``mod_reqtimeout``
    ``MinRate``, 500 B/s there). 16 KiB/s is 128 kbit/s, below any real client's link."""
    write_timeout_s: float = Field(default=30.0, gt=0)
    """A client that takes none of its answers' bytes for this long, while they wait to
    be sent, is disconnected: its answers are dropped and its requests' work cancelled
    (nginx's ``send_timeout``, 60 s there)."""
    output_buffer_bytes: int = Field(default=1024 * 1024, ge=64 * 1024)
    """Answer bytes one connection may hold unsent (written but not yet taken by the
    client, plus answers waiting for an earlier one); past it the connection's requests
    are neither read nor started until its client catches up."""
    http_server: Literal["native", "uvicorn"] = "native"
    """``native``: the service's own HTTP/1.1 server (``gpu_service/transport.py``; a bare
    app built that way answers about 4x the requests/s of one under uvicorn,
    docs/benchmarks.md); ``uvicorn``: the same app as ASGI under uvicorn."""
    inline_parse_bytes: int = Field(default=64 * 1024, ge=0)
    """Bodies up to this size are decoded, prepared and encoded on the event loop; bigger
    ones (and their tokenising) on the parse threads, so health and small requests stay
    fast while big ones are parsed."""
    parse_threads: int = Field(default=2, ge=1, le=64)
    """Threads that decode binary bodies, prepare (tokenise) and encode big requests off
    the event loop."""
    parse_processes: int = Field(default=2, ge=1, le=64)
    """Processes that decode big JSON bodies (Python's JSON parser holds the GIL for the
    whole document, so a thread would still stall the event loop)."""
    max_elements_per_input: int = Field(default=16 * 1024 * 1024, ge=1)
    """Largest element count of one input tensor."""
    max_bytes_per_element: int = Field(default=64 * 1024, ge=1)
    """Longest BYTES element (e.g. one text) accepted."""
    adaptive_batching: bool = False
    """Set the batch target from the observed arrival rate (see docs/gpu-service.md)."""
    early_dispatch: bool = True
    """Dispatch a batch before its target or queue delay when waiting cannot gain a row
    (nothing on its way, nobody left to send, or no arrival expected in the time left), so
    a lone request never waits out the delay."""
    min_batch_size: int | None = Field(default=None, ge=1)
    """Hold a batch until this many rows wait, but never past the queue delay."""
    priority_aging_ms: float = Field(default=100.0, gt=0)
    """A request waiting this long is served before fresher ones whatever its priority."""
    fair_share: bool = True
    """Batchers take waiting requests tenant by tenant, the tenant served least lately
    first (by the tenant scope the data plane hands down), so one tenant's flood never
    holds a model while another's requests wait. Off: first come, first served."""
    fair_share_half_life_s: float = Field(default=1.0, gt=0, le=3600)
    """How quickly a tenant's past use of a model stops counting against it (halves)."""
    default_timeout_ms: float | None = Field(default=None, gt=0)
    """Deadline for requests without one, when the model's config sets none."""
    retry_after_s: float = Field(default=1.0, gt=0)
    """The ``Retry-After`` hint sent with 429 when a queue is full."""
    drain_timeout_s: float = Field(default=30.0, gt=0)
    """On SIGTERM: how long in-flight and queued work may take before exit."""
    async_concurrency: int = Field(default=16, ge=0, le=1024)
    """Asynchronous requests (``ASYNC_*``) this service runs at once, taken from the queue
    only while its batchers have room; 0: it does not consume the async queue."""
    model_control_mode: Literal["none", "poll", "explicit"] = "none"
    """Triton's flag: ``none`` loads every model at start and refuses control requests;
    ``poll`` also re-reads the repository every ``repository_poll_secs``; ``explicit``
    accepts ``/v2/repository/models/{m}/load`` and ``/unload``."""
    repository_poll_secs: float = Field(default=15.0, gt=0)
    """How often ``poll`` mode re-reads the repository for new and removed versions."""
    startup_models: tuple[str, ...] = ("*",)
    """Models loaded at start (``*``: all); in ``explicit`` mode others load on request."""
    memory_budget_mb: float | None = Field(default=None, gt=0)
    """Cap on the summed footprint of loaded versions; idle versions are evicted (LRU)."""
    idle_ttl_s: float | None = Field(default=None, gt=0)
    """Unload a version idle this long, unless pinned (a model's ``idle_ttl_seconds`` wins)."""
    cold_start_timeout_s: float = Field(default=60.0, gt=0)
    """How long a request without a deadline waits for its model to load."""
    admin_token: SecretStr | None = None
    """When set, control requests need ``Authorization: Bearer <token>``."""
    cache_dir: Path = Path("/tmp/spillway-models")  # noqa: S108 - a cache, not a secret
    """Where versions downloaded from S3 are kept."""
    log_level: str = "INFO"
    """Log level of the service."""

    def compute_layout(self) -> tuple[int, int]:
        """ONNX Runtime intra-op threads per slot, and the compute budget's slots, each
        ``auto`` resolved.

        On the CPU, ``auto`` is one thread per slot and one slot per core this process
        may use: runs and CPU steps never outnumber cores, and a run waits in its batcher,
        not on the CPU (docs/benchmarks.md, "One compute budget", measured the choice).
        On the GPU: one thread per run (the device computes) and two slots, so one batch
        is formed and copied while another computes."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
        cores = cores or os.cpu_count() or 1
        threads = 1 if self.intra_op_threads == "auto" else self.intra_op_threads
        if self.compute_slots != "auto":
            return threads, self.compute_slots
        if self.on_gpu:
            return threads, 2
        return threads, max(1, cores // max(threads, 1))

    @property
    def on_gpu(self) -> bool:
        """Whether models compute on a GPU (CUDA first and available)."""
        return self.providers[:1] == (CUDA,) and CUDA in ort.get_available_providers()

    def wide_threads(self) -> int:
        """Intra-op threads of a run that has the device to itself (0: no such runs)."""
        threads, slots = self.compute_layout()
        if not self.wide_runs or self.on_gpu or slots < 2:
            return 0
        return threads * slots

    def compute_slots_per_bucket(self) -> int:
        """Batches of one model version and length bucket that may compute at once."""
        if self.instance_count != "auto":
            return self.instance_count
        return self.compute_layout()[1]

    def engine_options(self, slots_per_run: int = 1) -> EngineOptions:
        """The engine options these settings describe, for a model whose runs hold
        ``slots_per_run`` slots of the budget."""
        return EngineOptions(
            providers=self.providers,
            intra_op_threads=self.compute_layout()[0] * slots_per_run,
            wide_threads=self.wide_threads(),
            inter_op_threads=self.inter_op_threads,
            max_elements_per_input=self.max_elements_per_input,
            max_bytes_per_element=self.max_bytes_per_element,
        )
