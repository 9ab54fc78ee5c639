"""``GET /metrics``: Prometheus text exposition with Triton-like names.

The per-request counters (success and the queue and compute durations) are those of the
statistics endpoint, recorded together when a request is answered and rendered here in
one synchronous pass on the event loop: one scrape is one consistent snapshot.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from gpu_service.registry import ModelRegistry
from gpu_service.served import ModelEntry
from gpu_service.stats import BATCH_BUCKETS
from gpu_service.versions import ServedVersion

_COUNTERS = (
    (
        "nv_inference_request_success",
        "Successful inference requests",
        lambda s: s.stats.success.count,
    ),
    ("nv_inference_request_failure", "Failed inference requests", lambda s: s.stats.fail.count),
    (
        "nv_inference_count",
        "Inferences performed (rows; a batch of N counts N)",
        lambda s: s.stats.inference_count,
    ),
    (
        "nv_inference_exec_count",
        "Model executions (batches) performed",
        lambda s: s.stats.execution_count,
    ),
    (
        "nv_inference_request_duration_us",
        "Cumulative end-to-end time of successful requests",
        lambda s: s.stats.success.ns // 1000,
    ),
    (
        "nv_inference_queue_duration_us",
        "Cumulative time successful requests waited in the queue",
        lambda s: s.stats.queue.ns // 1000,
    ),
    (
        "nv_inference_compute_input_duration_us",
        "Cumulative decode and pre-processing time of successful requests",
        lambda s: s.stats.compute_input.ns // 1000,
    ),
    (
        "nv_inference_compute_infer_duration_us",
        "Cumulative model compute time of successful requests (each its whole batch run)",
        lambda s: s.stats.compute_infer.ns // 1000,
    ),
    (
        "nv_inference_compute_output_duration_us",
        "Cumulative output encoding time of successful requests",
        lambda s: s.stats.compute_output.ns // 1000,
    ),
    (
        "spillway_rejected_total",
        "Requests refused with 429 because the queue was full",
        lambda s: s.stats.rejected,
    ),
    (
        "spillway_expired_total",
        "Requests whose deadline passed in the queue",
        lambda s: s.stats.expired,
    ),
)
_GAUGES = (
    (
        "nv_inference_pending_request_count",
        "Requests queued or computing",
        lambda s: s.batcher.queue_depth + s.batcher.running,
    ),
    (
        "spillway_queue_depth",
        "Requests waiting in the batcher queue",
        lambda s: s.batcher.queue_depth,
    ),
    (
        "spillway_busy_fraction",
        "Share of the last 10 s spent computing",
        lambda s: round(s.batcher.busy_fraction(), 4),
    ),
    ("spillway_model_ready", "1 when the version serves", lambda s: int(s.ready)),
    (
        "spillway_model_load_seconds",
        "Time to fetch, load and warm the version",
        lambda s: round(s.load_seconds, 4),
    ),
    ("spillway_model_memory_bytes", "Measured footprint of the version", lambda s: s.footprint),
)


_MODEL_COUNTERS: tuple[tuple[str, str, Callable[[ModelEntry], int]], ...] = (
    (
        "spillway_model_loads_total",
        "Versions loaded (start-up, swaps and cold starts)",
        lambda e: e.loads,
    ),
    (
        "spillway_model_load_failures_total",
        "Versions that failed to fetch, verify, load or warm",
        lambda e: e.load_failures,
    ),
    (
        "spillway_cold_starts_total",
        "Loads triggered by a request for a model scaled to zero",
        lambda e: e.cold_starts,
    ),
    (
        "spillway_evictions_total",
        "Versions evicted to fit the memory budget",
        lambda e: e.evictions,
    ),
)


def _model_lines(registry: ModelRegistry) -> list[str]:
    lines: list[str] = []
    for name, help_text, read in _MODEL_COUNTERS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
        lines += [
            f'{name}{{model="{e.name}"}} {read(e)}' for _, e in sorted(registry.models.items())
        ]
    name = "spillway_memory_in_use_bytes"
    lines += [
        f"# HELP {name} Summed footprint of loaded versions",
        f"# TYPE {name} gauge",
        f"{name} {registry.memory_in_use()}",
    ]
    return lines


def _labels(served: ServedVersion) -> str:
    return f'model="{served.model.name}",version="{served.model.version}"'


def _histogram(served: Iterable[ServedVersion]) -> list[str]:
    name = "spillway_batch_size"
    lines = [f"# HELP {name} Rows per model execution", f"# TYPE {name} histogram"]
    for s in served:
        sizes = s.stats.batch_sizes
        labels = _labels(s)
        for edge in BATCH_BUCKETS:
            count = sum(c.count for size, c in sizes.items() if size <= edge)
            lines.append(f'{name}_bucket{{{labels},le="{edge}"}} {count}')
        total = sum(c.count for c in sizes.values())
        lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {total}')
        lines.append(f"{name}_sum{{{labels}}} {sum(k * c.count for k, c in sizes.items())}")
        lines.append(f"{name}_count{{{labels}}} {total}")
    return lines


class RpcCounts:
    """The gRPC port's calls by method and gRPC status (``OK``, ``NOT_FOUND``, …), and
    ``ModelStreamInfer``'s messages: requests read and answers sent, by the status each
    answer stands for. Counted by ``gpu_service.grpc_server`` (and ``grpc_errors``) as
    each call or message ends; calls gRPC refuses itself (over ``GPU_MAX_CONNECTIONS``, a
    message over the size limit) never reach it and are not counted."""

    def __init__(self) -> None:
        self.calls: Counter[tuple[str, str]] = Counter()
        self.stream_in = 0
        self.stream_out: Counter[str] = Counter()

    def lines(self) -> list[str]:
        calls, messages = "spillway_grpc_requests_total", "spillway_grpc_stream_messages_total"
        lines = [
            f"# HELP {calls} gRPC calls by method and gRPC status code",
            f"# TYPE {calls} counter",
        ]
        lines += [
            f'{calls}{{method="{method}",code="{code}"}} {n}'
            for (method, code), n in sorted(self.calls.items())
        ]
        lines += [
            f"# HELP {messages} ModelStreamInfer messages: requests received, answers sent "
            "by the gRPC status each stands for",
            f"# TYPE {messages} counter",
            f'{messages}{{direction="received",code=""}} {self.stream_in}',
        ]
        lines += [
            f'{messages}{{direction="sent",code="{code}"}} {n}'
            for code, n in sorted(self.stream_out.items())
        ]
        return lines


GRPC = RpcCounts()
"""The process's gRPC counts (one gRPC server a process, as one registry)."""


def render(registry: ModelRegistry) -> str:
    """The whole exposition for every loaded version."""
    served = registry.all_versions()
    lines: list[str] = []
    for kind, table in (("counter", _COUNTERS), ("gauge", _GAUGES)):
        for name, help_text, read in table:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            lines += [f"{name}{{{_labels(s)}}} {read(s)}" for s in served]
    lines += _histogram(served)
    lines += _model_lines(registry)
    lines += registry.pipelines.metric_lines()
    lines += GRPC.lines()
    return "\n".join(lines) + "\n"
