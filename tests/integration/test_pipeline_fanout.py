"""Fan-out and fan-in with real ONNX Runtime on toy graphs built here.

``spots`` finds each item's positive values (a ``TopK`` graph: the values sorted, and how
many are positive, per item), then maps ``scale`` (one value -> ``[v, 10 v, 100 v]``)
over those rows. The pipeline batches, so the rows are padded per item: ``[B, 4, 1]``
in, ``[B, 4, 3]`` out, item i's rows first in its slots. Served by the GPU service's data
plane in-process, the CPU fallback and a batch job's pipeline model.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from gpu_service.dataplane import DataPlane
from gpu_service.registry import ModelRegistry
from gpu_service.settings import GpuSettings
from spillway.fallback.service import CpuService
from spillway.fallback.settings import CpuSettings
from spillway.models.engine import EngineOptions
from spillway.models.processing import Tensors
from spillway.models.repository import LocalRepository
from spillway.pipelines.serving import load_pipeline_version
from spillway.protocol.codec import decode_response, encode_request
from spillway_cli.modelbuild.common import write_checksums

SLOTS = 4
SCALE = np.array([[1.0, 10.0, 100.0]], dtype=np.float32)
THREE = np.array([[1, 2, -1, -1], [-1, -1, -1, -1], [4, 5, 6, -1]], dtype=np.float32)
ONE = np.array([[0.5, -3, -1, -2]], dtype=np.float32)


def _model(graph: onnx.GraphProto) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def spots_graph() -> onnx.ModelProto:
    """x ``[B, 4]`` -> rows ``[B, 4, 1]`` (x sorted, largest first), counts ``[B, 1]``
    (how many are positive: those rows come first)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", SLOTS])
    rows = helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["batch", SLOTS, 1])
    counts = helper.make_tensor_value_info("counts", TensorProto.INT64, ["batch", 1])
    constants = [
        numpy_helper.from_array(np.array([SLOTS], dtype=np.int64), "k"),
        numpy_helper.from_array(np.array([2], dtype=np.int64), "last"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "across"),
        numpy_helper.from_array(np.array(0, dtype=np.float32), "zero"),
    ]
    nodes = [
        helper.make_node("TopK", ["x", "k"], ["sorted", "order"], axis=-1, largest=1),
        helper.make_node("Unsqueeze", ["sorted", "last"], ["rows"]),
        helper.make_node("Greater", ["x", "zero"], ["positive"]),
        helper.make_node("Cast", ["positive"], ["ones"], to=TensorProto.INT64),
        helper.make_node("ReduceSum", ["ones", "across"], ["counts"], keepdims=1),
    ]
    return _model(helper.make_graph(nodes, "spots", [x], [rows, counts], constants))


def scale_graph() -> onnx.ModelProto:
    """v ``[B, 1]`` -> ``v @ [[1, 10, 100]]``."""
    v = helper.make_tensor_value_info("v", TensorProto.FLOAT, ["batch", 1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])
    node = helper.make_node("MatMul", ["v", "w"], ["y"])
    weights = [numpy_helper.from_array(SCALE, "w")]
    return _model(helper.make_graph([node], "scale", [v], [y], weights))


def write(root: Path, name: str, config: dict[str, Any], model: onnx.ModelProto | None) -> None:
    (root / name / "1").mkdir(parents=True)
    if model is not None:
        onnx.save(model, root / name / "1" / "model.onnx")
    write_checksums(root / name / "1")
    (root / name / "config.json").write_text(json.dumps({"name": name, **config}))


def fp32(name: str, dims: list[int]) -> dict[str, Any]:
    return {"name": name, "data_type": "TYPE_FP32", "dims": dims}


COUNTS = {"name": "counts", "data_type": "TYPE_INT64", "dims": [1]}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fanout-repo")
    write(
        root,
        "spots",
        {
            "max_batch_size": 8,
            "input": [fp32("x", [SLOTS])],
            "output": [fp32("rows", [SLOTS, 1]), COUNTS],
            # Both requests' items split in one run, so their rows reach scale together.
            "dynamic_batching": {
                "preferred_batch_size": [4],
                "max_queue_delay_microseconds": 30_000_000,
            },
        },
        spots_graph(),
    )
    # A batch of scale leaves at 6 rows (or after 30 s): the GPU test's two requests'
    # rows (5 and 1) make one run.
    write(
        root,
        "scale",
        {
            "max_batch_size": 8,
            "input": [fp32("v", [1])],
            "output": [fp32("y", [3])],
            "dynamic_batching": {
                "preferred_batch_size": [6],
                "max_queue_delay_microseconds": 30_000_000,
            },
        },
        scale_graph(),
    )
    steps = [
        {
            "model_name": "spots",
            "input_map": {"x": "x"},
            "output_map": {"rows": "rows", "counts": "counts"},
        },
        {
            "model_name": "scale",
            "input_map": {"v": "rows"},
            "output_map": {"y": "scaled"},
            "spillway": {"map": {"over": "rows", "counts": "counts"}},
        },
    ]
    write(
        root,
        "positives",
        {
            "platform": "ensemble",
            "max_batch_size": 8,
            "input": [fp32("x", [SLOTS])],
            "output": [fp32("scaled", [SLOTS, 3]), COUNTS],
            "ensemble_scheduling": {"step": steps},
        },
        None,
    )
    return root


def expected(x: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """By hand: each item's positive values, largest first, scaled, padded with zeros."""
    out = np.zeros((len(x), SLOTS, 3), dtype=np.float32)
    counts = []
    for i, row in enumerate(x):
        values = sorted((v for v in row if v > 0), reverse=True)
        out[i, : len(values)] = np.array(values, dtype=np.float32).reshape(-1, 1) @ SCALE
        counts.append(len(values))
    return out, counts


def check(outputs: Tensors, x: np.ndarray) -> None:
    scaled, counts = expected(x)
    assert outputs["counts"].reshape(-1).tolist() == counts
    np.testing.assert_allclose(outputs["scaled"], scaled, rtol=1e-6)


def request(x: np.ndarray) -> tuple[bytes, int | None]:
    return encode_request({"x": x}, binary=True, binary_outputs=True)


def test_the_counts_of_the_three_items_are_two_none_and_three() -> None:
    assert expected(THREE)[1] == [2, 0, 3]
    assert expected(ONE)[1] == [1]


def test_the_gpu_service_batches_rows_of_two_requests_and_gives_each_its_own(repo: Path) -> None:
    async def main() -> tuple[list[Tensors], dict[str, Any]]:
        settings = GpuSettings(providers=("CPUExecutionProvider",))
        registry = ModelRegistry(LocalRepository(repo), settings)
        await registry.start()
        plane = DataPlane(registry, settings)
        try:
            # WHEN a request of three items (2, 0 and 3 rows) and one of one item
            # (1 row) arrive together
            answers = await asyncio.gather(
                plane.infer("positives", None, *request(THREE)),
                plane.infer("positives", None, *request(ONE)),
            )
            stats = registry.get("scale").stats
            return [decode_response(a.body, a.header_length)[1] for a in answers], {
                "executions": stats.execution_count,
                "rows": stats.inference_count,
                "batches": sorted(stats.batch_sizes),
            }
        finally:
            await registry.stop(5)
            plane.close()

    (three, one), stats = asyncio.run(main())
    # THEN each got its own items' rows, in order
    check(three, THREE)
    check(one, ONE)
    # AND the per-row model ran the six rows of both requests as one batch
    assert stats == {"executions": 1, "rows": 6, "batches": [6]}


def test_the_cpu_fallback_serves_the_mapped_step(repo: Path) -> None:
    cpu = CpuService.load(CpuSettings(repository=str(repo), models=["positives"]))
    for x in (THREE, ONE, np.full((2, SLOTS), -1, dtype=np.float32)):
        encoded = cpu.infer("positives", None, *request(x))
        check(decode_response(encoded.body, encoded.header_length)[1], x)
    stats = cpu.pipelines.served["positives"].stats.step(1)
    # The request whose items have no rows called no model.
    assert (stats.runs, stats.rows, stats.executions) == (3, 6, 2)


def test_a_batch_job_runs_records_through_the_mapped_step(repo: Path, tmp_path: Path) -> None:
    repository = LocalRepository(repo)
    job = load_pipeline_version(
        repository,
        repository.read_config("positives"),
        1,
        tmp_path,
        EngineOptions(providers=("CPUExecutionProvider",)),
        scope="t-job",
    )
    records = [THREE[:1], THREE[1:2], THREE[2:], ONE]
    outputs = job.run([job.prepare({"x": x}) for x in records])
    for x, out in zip(records, outputs, strict=True):
        check(out, x)
