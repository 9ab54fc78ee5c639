"""One trace per request across the running local stack, read back from its receiver.

A lookup model (``Gather`` rows of a table by index) is published with a configuration
that lets the GPU service batch two requests. One caller sends a valid index and the
other one past the table: the shared batch's run fails, the GPU service answers both with
its own-fault 500, and the router falls back to the CPU function, which runs each request
alone: the valid one is served there, the poisoned one fails there too. Each request is
one trace in ``spillway up``'s receiver: the router's route, decision and two attempts,
the GPU service's request, queue and batch (one span for the shared batch, linked to
both requests), the CPU function's request.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper, save

from spillway.models.config import ModelConfig
from spillway.models.repository import open_repository
from spillway_cli.dashboard.traces import wait_for_trace
from spillway_cli.demo.client import Client
from spillway_cli.local.names import REPOSITORY
from spillway_cli.local.stack import LocalStack
from tests.fakes import eventually

MODEL = "table-lookup"
CALLERS = {
    "valid": "0af7651916cd43dd8448eb211c80319c",
    "poisoned": "9f3c2d1e0b4a5f6e7d8c9b0a1f2e3d4c",
}
"""Each caller's request, and the trace id its client sends."""
Span = dict[str, Any]


TABLE = np.arange(12, dtype=np.float32).reshape(4, 3)


def lookup(path: Path) -> Path:
    """``y = TABLE[idx]``: an index past the table's 4 rows fails the run it is in."""
    table = numpy_helper.from_array(TABLE, "table")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "idx"], ["y"], axis=0)],
        MODEL,
        [helper.make_tensor_value_info("idx", TensorProto.INT64, ["batch", 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1, 3])],
        [table],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    save(model, str(path))
    return path


def _restart_gpu(stack: LocalStack, settings: dict[str, str]) -> None:
    stack.children.pop("gpu").stop()
    stack.gpu_settings.clear()
    stack.gpu_settings.update(settings)
    stack.start_gpu()


@pytest.fixture(scope="module")
def published(stack: LocalStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The model in the stack's repository, declared batchable two at a time with a
    10 s queue delay, on a GPU service that waits out the delay for a full batch
    (``GPU_EARLY_DISPATCH=false``, as Triton's batcher does): two requests sent together
    share one batch, whatever the machine's timing. The GPU service is put back as it
    was afterwards."""
    path = lookup(tmp_path_factory.mktemp("traced") / "model.onnx")
    config = ModelConfig.model_validate(
        {
            "name": MODEL,
            "platform": "onnxruntime_onnx",
            "max_batch_size": 2,
            "input": [{"name": "idx", "data_type": "TYPE_INT64", "dims": [1]}],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [1, 3]}],
            "dynamic_batching": {"max_queue_delay_microseconds": 10_000_000},
        }
    )
    open_repository(REPOSITORY).publish_version(MODEL, {"model.onnx": path}, config)
    before = dict(stack.gpu_settings)
    _restart_gpu(stack, {**before, "GPU_EARLY_DISPATCH": "false"})
    try:
        yield MODEL
    finally:
        _restart_gpu(stack, before)


def _by_name(spans: list[Span], name: str) -> list[Span]:
    return [s for s in spans if s["name"] == name]


def _one(spans: list[Span], name: str) -> Span:
    found = _by_name(spans, name)
    assert len(found) == 1, f"{len(found)} {name} spans in {[s['name'] for s in spans]}"
    return found[0]


def test_a_fallback_is_one_trace_from_the_router_to_the_cpu_function(
    stack: LocalStack, published: str
) -> None:
    client = Client(stack.ports.router)
    # the valid request's index is in the table; the poisoned one's is not
    rows = {"valid": np.array([[2]], np.int64), "poisoned": np.array([[7]], np.int64)}

    def send(caller: str) -> tuple[int, dict[str, str], dict[str, np.ndarray]]:
        headers = {"traceparent": f"00-{CALLERS[caller]}-{'ab' * 8}-01"}
        return client.infer("traces", published, {"idx": rows[caller]}, headers=headers)

    # WHEN two callers' requests are sent together (one GPU batch of two rows)
    with ThreadPoolExecutor(2) as pool:
        answers = dict(zip(CALLERS, pool.map(send, CALLERS), strict=True))
    # THEN both fell back from the GPU's failed batch; the CPU function serves the valid
    # one (alone, unharmed by its batch-mate) and fails the poisoned one too
    for _, headers, _ in answers.values():
        assert headers["x-spillway-backend"] == "cpu", answers
        assert headers["x-spillway-fallback"] == "gpu:server_fault"
    status, _, outputs = answers["valid"]
    assert status == 200, outputs
    np.testing.assert_array_equal(outputs["y"], TABLE[[[2]]])
    assert answers["poisoned"][0] == 500

    # AND each request is one trace in the receiver, with every tier's spans
    # Each trace: route, decide, two attempts, the GPU's request and queue, the CPU's
    # request; and the shared batch in one of them (a child of its first request).
    def both() -> dict[str, list[Span]] | None:
        url = stack.url("traces")
        found = {
            t: wait_for_trace(url, trace, spans_at_least=7)["spans"] for t, trace in CALLERS.items()
        }
        return found if sum(len(spans) for spans in found.values()) >= 15 else None

    traces = eventually(both, "both traces with their 15 spans", interval_s=0.2)
    infers: dict[str, Span] = {}
    for caller, spans in traces.items():
        route = _one(spans, "spillway.route")
        assert route["service"] == "spillway-router"
        assert route["parent_span_id"] == "ab" * 8  # the client's span
        assert route["attributes"]["spillway.fallback"] == "gpu:server_fault"
        assert _one(spans, "spillway.decide")["parent_span_id"] == route["span_id"]
        gpu_try, cpu_try = sorted(_by_name(spans, "spillway.attempt"), key=lambda s: s["start_ns"])
        assert gpu_try["attributes"]["spillway.backend"] == "gpu"
        assert gpu_try["status"]["code"] == "error"
        assert cpu_try["attributes"]["spillway.fallback_from"] == "gpu:server_fault"
        infer = _one(spans, "spillway.gpu.infer")
        assert infer["service"] == "spillway-gpu"
        assert infer["parent_span_id"] == gpu_try["span_id"]
        queue = _one(spans, "spillway.queue")
        assert queue["parent_span_id"] == infer["span_id"]
        cpu = _one(spans, "spillway.cpu.infer")
        assert cpu["service"] == "spillway-cpu"
        assert cpu["parent_span_id"] == cpu_try["span_id"]
        assert (cpu["status"]["code"] == "error") == (caller == "poisoned")
        infers[caller] = infer
    # AND the one batch that carried both is a span in the first request's trace,
    # linked to both requests' GPU spans
    batches = [s for spans in traces.values() for s in _by_name(spans, "spillway.batch")]
    assert len(batches) == 1
    [batch] = batches
    assert batch["status"]["code"] == "error"
    assert batch["attributes"]["spillway.batch.requests"] == 2
    linked = {(link["trace_id"], link["span_id"]) for link in batch["links"]}
    assert linked == {(CALLERS[t], infers[t]["span_id"]) for t in CALLERS}
    assert batch["parent_span_id"] in {infer["span_id"] for infer in infers.values()}
