"""A model's configuration completed from its ONNX graph, as Triton completes one.

The graph's inputs and outputs (names, datatypes, shapes) give the served signature. A
model batches when every input and output has a dynamic leading dimension: then
``max_batch_size`` is set and ``dims`` exclude that dimension; otherwise
``max_batch_size`` is 0 and ``dims`` are the whole shape. Dimensions that are not fixed
are ``-1``. The graph is read with ONNX Runtime, which every deployable has (the ``onnx``
package is a build-time tool and is not in the service images).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from spillway.models.config import ModelConfig, SpillwayBlock, TensorConfig
from spillway.models.processing import GraphTensor
from spillway.protocol.datatypes import from_onnx_type
from spillway.protocol.errors import ModelLoadError, SpillwayError

DEFAULT_MAX_BATCH_SIZE = 8
"""``max_batch_size`` of a batchable graph whose configuration nobody wrote: clients may
send up to this many rows, and without a ``dynamic_batching`` block the service never
puts two requests in one run (that needs the batch-safety proof of ``models add``)."""


@dataclass(frozen=True)
class GraphSignature:
    """A graph's inputs and outputs as ONNX Runtime reports them."""

    inputs: tuple[GraphTensor, ...]
    outputs: tuple[GraphTensor, ...]

    @property
    def batchable(self) -> bool:
        """Whether every input and output leads with a dynamic (batch) dimension."""
        tensors = self.inputs + self.outputs
        return all(t.shape and not isinstance(t.shape[0], int) for t in tensors)

    def input(self, name: str) -> GraphTensor | None:
        """The graph input called ``name``, if there is one."""
        return next((t for t in self.inputs if t.name == name), None)


def read_signature(path: Path) -> GraphSignature:
    """The inputs and outputs of the ONNX file at ``path``; ModelLoadError if it is no
    model ONNX Runtime can load."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        session = ort.InferenceSession(
            str(path), sess_options=options, providers=["CPUExecutionProvider"]
        )
        return GraphSignature(
            tuple(_tensor(a) for a in session.get_inputs()),
            tuple(_tensor(a) for a in session.get_outputs()),
        )
    except SpillwayError:
        raise
    except Exception as exc:  # ONNX Runtime raises its own unrelated classes
        raise ModelLoadError(f"ONNX Runtime cannot read {path.name}: {exc}") from exc


def _tensor(arg: object) -> GraphTensor:
    name, kind, shape = (getattr(arg, a) for a in ("name", "type", "shape"))
    return GraphTensor(str(name), from_onnx_type(str(kind)), tuple(shape or ()))


def triton_type(datatype: str) -> str:
    """The Triton ``data_type`` for an Open Inference Protocol datatype."""
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def tensor_config(tensor: GraphTensor, batching: bool, name: str | None = None) -> TensorConfig:
    """A graph tensor as a served one: without its batch dimension when batching."""
    shape = tensor.shape[1:] if batching else tensor.shape
    dims = tuple(d if isinstance(d, int) and d > 0 else -1 for d in shape)
    return TensorConfig(name=name or tensor.name, data_type=triton_type(tensor.datatype), dims=dims)


def config_from_signature(
    name: str,
    signature: GraphSignature,
    *,
    max_batch_size: int | None = None,
    spillway: SpillwayBlock | None = None,
) -> ModelConfig:
    """A tensor model's configuration from its graph: ``max_batch_size`` is
    ``max_batch_size`` (default ``DEFAULT_MAX_BATCH_SIZE``) when the graph is batchable,
    else 0; ``max_batch_size=0`` serves a batchable graph one request per run, its whole
    shape as ``dims``."""
    limit = DEFAULT_MAX_BATCH_SIZE if max_batch_size is None else max_batch_size
    batch = limit if signature.batchable else 0
    return ModelConfig(
        name=name,
        max_batch_size=batch,
        input=tuple(tensor_config(t, batch > 0) for t in signature.inputs),
        output=tuple(tensor_config(t, batch > 0) for t in signature.outputs),
        spillway=spillway or SpillwayBlock(),
    )
