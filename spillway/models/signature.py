"""A model's configuration completed from its ONNX graph, as Triton completes one.

The graph's inputs and outputs (names, datatypes, shapes) give the served signature. A
model batches when every input and output has a dynamic leading dimension: then
``max_batch_size`` is set and ``dims`` exclude that dimension; otherwise
``max_batch_size`` is 0 and ``dims`` are the whole shape. Dimensions that are not fixed
are ``-1``. The graph is read with ONNX Runtime, which every deployable has (the ``onnx``
package is a build-time tool and is not in the service images).

An image model (``image_config``) serves its graph's float image input as a BYTES input of
encoded images instead: the layout comes from where the graph has 1 or 3 channels, the size
from its fixed height and width (or the caller's, where they are dynamic).

What callers see of a configuration is its signature: the served inputs and outputs, each
a name, a datatype and a shape with the batch (``served_shape``), and the kind.
``signature_differences`` lists what changes between two; ``refit`` applies a served
configuration to another graph, so that a new version can be checked against it.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from spillway.models.config import ImageSpec, ModelConfig, SpillwayBlock, TensorConfig
from spillway.models.processing import GraphTensor
from spillway.protocol.datatypes import from_onnx_type
from spillway.protocol.errors import ModelLoadError, SpillwayError

log = logging.getLogger("spillway.repository")  # the repository completes configurations

FLOAT_TYPES = ("FP16", "FP32", "FP64")
CHANNELS = (1, 3)
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


@dataclass(frozen=True)
class ImageOptions:
    """How an image model's images are prepared, as ``models add --image`` takes it; a
    ``None`` is the image section's default (``spillway.models.config.ImageSpec``), and
    the color defaults to GRAY for one channel, else RGB."""

    size: tuple[int, int] | None = None
    """``[height, width]``; needed where the graph's are dynamic."""
    color: str | None = None
    resize: str | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    scale: float | None = None

    def section(self) -> dict[str, Any]:
        """The options given, as image section fields (without ``size``)."""
        fields = {
            "color": self.color,
            "resize": self.resize,
            "mean": self.mean,
            "std": self.std,
            "scale": self.scale,
        }
        return {key: value for key, value in fields.items() if value is not None}


def image_config(
    name: str, signature: GraphSignature, options: ImageOptions, *, max_batch_size: int
) -> ModelConfig:
    """An ``image`` model's configuration: the graph's one rank-4 float input is served as
    a BYTES input of the same name, one encoded image per row; the other inputs and the
    outputs as ``config_from_signature`` makes them. ModelLoadError in one line where the
    graph has no such input, its channel axis is unclear or its size unknown."""
    target = _image_input(signature)
    layout, channels, (height, width) = _image_axes(target)
    size = _image_size(target, (height, width), options.size)
    section = {"color": "GRAY" if channels == 1 else "RGB", **options.section()}
    if (section["color"] == "GRAY") != (channels == 1):
        raise ModelLoadError(
            f"graph input {target.name!r} has {channels} channel(s); color {section['color']} "
            f"has {3 if channels == 1 else 1}"
        )
    tensors = config_from_signature(name, signature, max_batch_size=max_batch_size)
    served = TensorConfig(name=target.name, data_type="TYPE_STRING", dims=(1,))
    try:
        spec = ImageSpec.model_validate(
            {"input": target.name, "layout": layout, "size": size, **section}
        )
        return ModelConfig(
            name=name,
            max_batch_size=tensors.max_batch_size,
            input=tuple(served if t.name == target.name else t for t in tensors.input),
            output=tensors.output,
            spillway=SpillwayBlock(kind="image", image=spec),
        )
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise ModelLoadError(
            f"image options: {where + ': ' if where else ''}{error['msg']}"
        ) from None


def _image_input(signature: GraphSignature) -> GraphTensor:
    images = [t for t in signature.inputs if t.datatype in FLOAT_TYPES and len(t.shape) == 4]
    if len(images) == 1:
        return images[0]
    if images:
        names = ", ".join(t.name for t in images)
        raise ModelLoadError(f"an image model takes one rank-4 float input; this graph has {names}")
    found = ", ".join(f"{t.name} {t.datatype} {list(t.shape)}" for t in signature.inputs)
    raise ModelLoadError(
        f"an image model needs a rank-4 float input ([N, C, H, W] or [N, H, W, C]); "
        f"this graph takes {found}"
    )


Dimension = int | str | None


def _image_axes(tensor: GraphTensor) -> tuple[str, int, tuple[Dimension, Dimension]]:
    """The layout, the channels and the (height, width) dimensions of an image input:
    NCHW where dimension 1 is 1 or 3, else NHWC where dimension 3 is."""
    _, first, middle, last = tensor.shape
    if isinstance(first, int) and first in CHANNELS:
        return "NCHW", first, (middle, last)
    if isinstance(last, int) and last in CHANNELS:
        return "NHWC", last, (first, middle)
    raise ModelLoadError(
        f"graph input {tensor.name!r} {list(tensor.shape)} has 1 or 3 channels at neither "
        "dimension 1 (NCHW) nor dimension 3 (NHWC)"
    )


def _image_size(
    tensor: GraphTensor, graph: tuple[Dimension, Dimension], given: tuple[int, int] | None
) -> tuple[int, int]:
    """The tensor's [height, width]: ``given``, which must agree with the graph's fixed
    dimensions, else the graph's own when both are fixed."""
    fixed = [d if isinstance(d, int) and d > 0 else None for d in graph]
    if given is None:
        height, width = fixed
        if height is None or width is None:
            raise ModelLoadError(
                f"graph input {tensor.name!r} {list(tensor.shape)} has a dynamic height or "
                "width: give the size images are resized to (--image-size H W)"
            )
        return height, width
    if any(want is not None and want != got for want, got in zip(fixed, given, strict=True)):
        raise ModelLoadError(
            f"image size {given[0]}x{given[1]} does not fit graph input {tensor.name!r} "
            f"{list(tensor.shape)}"
        )
    return given


def completed_config(model: str, graph: Path) -> ModelConfig:
    """The configuration of a folder's ``graph`` nobody configured
    (``config_from_signature``), read again only when the file changes (a poll asks every
    few seconds)."""
    stat = graph.stat()
    return _config_of_graph(model, str(graph), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)
def _config_of_graph(model: str, graph: str, _mtime_ns: int, _size: int) -> ModelConfig:
    config = config_from_signature(model, read_signature(Path(graph)))
    log.info(
        "config of %s completed from its graph: max_batch_size %d", model, config.max_batch_size
    )
    return config


# -- the signature callers see ------------------------------------------------------------


def served_shape(config: ModelConfig, tensor: TensorConfig) -> tuple[int, ...]:
    """The shape a caller sends or gets: ``-1`` (any batch) ahead of ``dims`` when the
    model batches."""
    return (-1, *tensor.dims) if config.max_batch_size > 0 else tensor.dims


def describe_tensor(config: ModelConfig, tensor: TensorConfig) -> str:
    """``name DATATYPE [shape]``, as a caller sees the tensor."""
    return f"{tensor.name} {tensor.datatype} {list(served_shape(config, tensor))}"


def signature_differences(before: ModelConfig, after: ModelConfig) -> list[str]:
    """What a caller of ``before`` finds changed in ``after``, one phrase each: the kind,
    then each input and output gone, new, or of another datatype or shape."""
    kinds = (before.spillway.kind, after.spillway.kind)
    found = [] if kinds[0] == kinds[1] else [f"kind {kinds[0]} -> {kinds[1]}"]
    for role, old, new in (
        ("input", before.input, after.input),
        ("output", before.output, after.output),
    ):
        kept = {t.name: t for t in new}
        for tensor in old:
            match = kept.pop(tensor.name, None)
            if match is None:
                found.append(f"{role} {_quoted(before, tensor)} is gone")
                continue
            if tensor.datatype != match.datatype:
                found.append(
                    f"{role} {tensor.name!r} datatype {tensor.datatype} -> {match.datatype}"
                )
            was, now = list(served_shape(before, tensor)), list(served_shape(after, match))
            if was != now:
                found.append(f"{role} {tensor.name!r} shape {was} -> {now}")
        found += [f"new {role} {_quoted(after, t)}" for t in kept.values()]
    return found


def _quoted(config: ModelConfig, tensor: TensorConfig) -> str:
    return f"{tensor.name!r} {tensor.datatype} {list(served_shape(config, tensor))}"


def refit(config: ModelConfig, signature: GraphSignature) -> ModelConfig:
    """``config``'s kind, processing and batching applied to another graph: the
    configuration with the tensors callers would see if ``signature``'s graph were served
    under it. ModelLoadError in one line where the kind cannot take the graph."""
    kind, batch = config.spillway.kind, config.max_batch_size
    if config.is_pipeline:
        raise ModelLoadError(f"{config.name} is a pipeline: its versions hold no graph")
    if kind == "tensor":
        tensors = config_from_signature(config.name, signature, max_batch_size=batch)
        return config.model_copy(update={"input": tensors.input, "output": tensors.output})
    outputs = config_from_signature(config.name, signature, max_batch_size=batch).output
    if kind == "image_classifier":
        _flattened_images(config, signature)
        return config.model_copy(update={"output": outputs})
    if kind == "image" and config.spillway.image is not None and config.spillway.image.size:
        spec = config.spillway.image
        made = image_config(
            config.name,
            signature,
            ImageOptions(size=spec.size, color=spec.color),
            max_batch_size=batch,
        )
        made_spec = made.spillway.image
        if made_spec is not None and made_spec.layout != spec.layout:
            raise ModelLoadError(
                f"the graph takes images {made_spec.layout}, the served model {spec.layout}"
            )
        return config.model_copy(update={"input": made.input, "output": made.output})
    if kind == "text_embedding":
        raise ModelLoadError("a text model's new version needs its tokenizer (--tokenizer)")
    raise ModelLoadError(
        f"a new {kind} version is published with `spillway models publish`, not made here"
    )


def _flattened_images(config: ModelConfig, signature: GraphSignature) -> None:
    """An image classifier's graph takes its served images flattened: one float input
    ``[batch, H*W]``."""
    served = config.input[0]
    size = math.prod(served.dims)
    graph = signature.inputs[0]
    fits = (
        len(signature.inputs) == 1
        and graph.datatype in FLOAT_TYPES
        and len(graph.shape) == 2
        and (size < 0 or not isinstance(graph.shape[1], int) or graph.shape[1] == size)
    )
    if not fits:
        found = ", ".join(f"{t.name} {t.datatype} {list(t.shape)}" for t in signature.inputs)
        raise ModelLoadError(
            f"an image classifier's graph takes its {served.name!r} images flattened, one "
            f"float input [batch, {size}]; this one takes {found}"
        )
