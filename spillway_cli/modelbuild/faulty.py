"""A faulty variant of a model: the same outputs, but ONNX Runtime fails on a share of
inputs, as a broken new version would. The demo's canary section and the canary tests
publish one as a new version and watch the router roll it back.

The graph gains a guard that every output depends on: a hash of the request's input
(the fractional part of its sum times an irrational factor, equidistributed over the
inputs) below ``share`` makes an index one past the end of a one-element tensor, and
the ``Gather`` on it fails the run (ONNX Runtime checks Gather's indices). Otherwise the
guard adds zero, so answers equal the original model's. The decision is per run: a
batch holding one failing input fails as a whole, as it would on a real fault.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from spillway.models.canary_spec import CanarySpec, RollbackBounds
from spillway.models.config import CHECKSUM_FILE, ModelConfig
from spillway.models.repository import ModelRepository

_FACTOR = 0.6180339887498949  # the golden ratio's fractional part: well spread fractions


def faulty_variant(model: onnx.ModelProto, share: float) -> onnx.ModelProto:
    """A copy of ``model`` whose runs fail for about ``share`` of inputs (0-1)."""
    if not 0 <= share <= 1:
        raise ValueError("share must be between 0 and 1")
    faulty = onnx.ModelProto()
    faulty.CopyFrom(model)
    graph = faulty.graph
    first_input = graph.input[0].name
    graph.initializer.extend(
        [
            numpy_helper.from_array(np.array(_FACTOR, np.float32), "guard_factor"),
            numpy_helper.from_array(np.array(share, np.float32), "guard_share"),
            numpy_helper.from_array(np.zeros(1, np.float32), "guard_slot"),
        ]
    )
    graph.node.extend(
        [
            helper.make_node("Cast", [first_input], ["guard_x"], to=TensorProto.FLOAT),
            helper.make_node("ReduceSum", ["guard_x"], ["guard_sum"], keepdims=0),
            helper.make_node("Mul", ["guard_sum", "guard_factor"], ["guard_scaled"]),
            helper.make_node("Floor", ["guard_scaled"], ["guard_floor"]),
            helper.make_node("Sub", ["guard_scaled", "guard_floor"], ["guard_fraction"]),
            helper.make_node("Less", ["guard_fraction", "guard_share"], ["guard_bad"]),
            helper.make_node("Cast", ["guard_bad"], ["guard_index"], to=TensorProto.INT64),
            helper.make_node("Gather", ["guard_slot", "guard_index"], ["guard_zero"], axis=0),
        ]
    )
    for output in graph.output:
        raw = f"{output.name}_unguarded"
        for node in graph.node:
            node.output[:] = [raw if name == output.name else name for name in node.output]
            node.input[:] = [raw if name == output.name else name for name in node.input]
        elem_type = output.type.tensor_type.elem_type
        graph.node.extend(
            [
                helper.make_node("Cast", ["guard_zero"], [f"{raw}_zero"], to=elem_type),
                helper.make_node("Add", [raw, f"{raw}_zero"], [output.name]),
            ]
        )
    onnx.checker.check_model(faulty)
    return faulty


def write_faulty_version(source: Path, target: Path, share: float) -> None:
    """Write the faulty variant of the ONNX file ``source`` to ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(faulty_variant(onnx.load(str(source)), share), str(target))


def publish_faulty_canary(
    repository: ModelRepository,
    model: str,
    *,
    share: float,
    percent: float,
    workdir: Path,
    bounds: RollbackBounds | None = None,
) -> tuple[int, int]:
    """Publish a faulty variant of ``model``'s newest version as its next version, with a
    configuration that serves both and names the new one as a ``percent`` canary
    (``spillway.canary``); the stable and canary version numbers."""
    config = repository.read_config(model)
    stable = repository.list_versions(model)[-1]
    folder = repository.fetch_version(model, stable, workdir)
    onnx_name = config.spillway.onnx_file
    faulty = workdir / f"{model}-faulty" / onnx_name
    write_faulty_version(folder / onnx_name, faulty, share)
    files = {p.name: p for p in folder.iterdir() if p.is_file() and p.name != CHECKSUM_FILE}
    files[onnx_name] = faulty
    canary = stable + 1
    spec = CanarySpec(
        version=canary, stable=stable, percent=percent, bounds=bounds or RollbackBounds()
    )
    document = config.model_dump(mode="json")
    document["version_policy"] = {"specific": {"versions": [stable, canary]}}
    document["spillway"]["canary"] = spec.model_dump(mode="json")
    published = repository.publish_version(model, files, ModelConfig.model_validate(document))
    if published != canary:
        raise RuntimeError(f"{model} v{published} was published where v{canary} was expected")
    return stable, canary
