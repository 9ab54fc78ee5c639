"""A BERT sentence encoder written as an ONNX graph with ``onnx.helper``, without torch.

:func:`load_bert` reads a Hugging Face BERT folder (``config.json`` and
``model.safetensors``, the latter with numpy alone) and :func:`sentence_encoder_model`
writes the graph: ``BertModel`` (absolute positions, token type 0, exact erf GELU, the
padding mask as an additive float32-min bias on masked keys, as Hugging Face applies it)
followed by masked mean pooling and L2 normalisation, as sentence-transformers'
``Transformer`` + ``Pooling(mean)`` + ``Normalize``.

The graph is shaped for ONNX Runtime's CPU optimizer, to fuse as well as a torch export:
Linear weights are stored transposed, so MatMul needs no Transpose at run time; GELU is
the Div/Erf/Add/Mul/Mul chain that fuses with its bias Add into ``BiasGelu``; and the
attention scale is a Mul right after the Q·Kᵀ MatMul, which folds into a ``FusedMatMul``.
Shape constants are initializers, not Shape/Gather/Concat chains, so nothing is computed
per run but the sequence length that slices the position table.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from numpy.typing import NDArray
from onnx import TensorProto, helper, numpy_helper

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
OUTPUT = "embedding"
ONNX_OPSET = 17
ONNX_IR_VERSION = 8  # the IR version that goes with opset 17; runtimes back to ORT 1.13 load it
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
POOLED_COUNT_MIN = 1e-9  # sentence-transformers' Pooling clamps the token count here
NORM_MIN = 1e-12  # torch.nn.functional.normalize's default eps

_BATCH = "batch"
_SEQUENCE = "sequence"
# The safetensors header is little-endian u64 length + JSON; the format caps it at 100 MB.
_HEADER_LENGTH = struct.Struct("<Q")
_MAX_HEADER_BYTES = 100_000_000
_DTYPES: dict[str, np.dtype[Any]] = {"F32": np.dtype("<f4"), "I64": np.dtype("<i8")}

Weights = Mapping[str, NDArray[Any]]


@dataclass(frozen=True)
class BertConfig:
    """The ``config.json`` values the encoder depends on."""

    vocab_size: int
    type_vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    layer_norm_eps: float
    max_position_embeddings: int

    @property
    def head_size(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> BertConfig:
        """Read a Hugging Face BERT ``config.json``; refuse variants the graph does not write."""
        for key, wanted in (("hidden_act", "gelu"), ("position_embedding_type", "absolute")):
            got = values.get(key, "absolute" if key == "position_embedding_type" else None)
            if got != wanted:
                raise ValueError(f"BERT config: {key}={got!r} is not supported (only {wanted!r})")
        config = cls(
            vocab_size=int(values["vocab_size"]),
            type_vocab_size=int(values["type_vocab_size"]),
            hidden_size=int(values["hidden_size"]),
            num_hidden_layers=int(values["num_hidden_layers"]),
            num_attention_heads=int(values["num_attention_heads"]),
            intermediate_size=int(values["intermediate_size"]),
            layer_norm_eps=float(values["layer_norm_eps"]),
            max_position_embeddings=int(values["max_position_embeddings"]),
        )
        if config.hidden_size % config.num_attention_heads:
            raise ValueError("BERT config: hidden_size is not a multiple of num_attention_heads")
        return config


def load_bert(model_dir: Path) -> tuple[BertConfig, dict[str, NDArray[Any]]]:
    """The config and weights of a Hugging Face BERT folder."""
    values = json.loads((model_dir / CONFIG_FILE).read_text(encoding="utf-8"))
    return BertConfig.from_dict(values), read_safetensors(model_dir / WEIGHTS_FILE)


def read_safetensors(path: Path) -> dict[str, NDArray[Any]]:
    """The tensors of a ``.safetensors`` file (F32 and I64), as read-only numpy arrays."""
    return parse_safetensors(path.read_bytes())


def parse_safetensors(data: bytes) -> dict[str, NDArray[Any]]:
    """Parse safetensors bytes: u64 little-endian header length, JSON header, raw data.

    ``__metadata__`` is ignored; a malformed header, an unsupported dtype or offsets that
    disagree with a tensor's shape raise ValueError.
    """
    if len(data) < _HEADER_LENGTH.size:
        raise ValueError("safetensors: shorter than its header length")
    (header_length,) = _HEADER_LENGTH.unpack_from(data)
    start = _HEADER_LENGTH.size + header_length
    if header_length > _MAX_HEADER_BYTES or start > len(data):
        raise ValueError(f"safetensors: header length {header_length} does not fit the file")
    header = json.loads(data[_HEADER_LENGTH.size : start])
    if not isinstance(header, dict):
        raise ValueError("safetensors: the header is not a JSON object")
    body = memoryview(data)[start:]
    return {
        name: _tensor(name, entry, body) for name, entry in header.items() if name != "__metadata__"
    }


def _tensor(name: str, entry: object, body: memoryview) -> NDArray[Any]:
    dtype_name = entry.get("dtype") if isinstance(entry, dict) else None
    dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if not isinstance(entry, dict) or dtype is None:
        raise ValueError(f"safetensors: {name}: dtype {dtype_name!r} not supported (F32, I64)")
    shape = _counts(name, "shape", entry.get("shape"))
    offsets = _counts(name, "data_offsets", entry.get("data_offsets"))
    count = math.prod(shape)
    if len(offsets) != 2 or not offsets[0] <= offsets[1] <= len(body):
        raise ValueError(f"safetensors: {name}: data_offsets {offsets} outside the data")
    if offsets[1] - offsets[0] != count * dtype.itemsize:
        raise ValueError(f"safetensors: {name}: data_offsets {offsets} do not hold {shape}")
    return np.frombuffer(body, dtype=dtype, count=count, offset=offsets[0]).reshape(shape)


def _counts(name: str, field: str, value: object) -> list[int]:
    if isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        return value
    raise ValueError(f"safetensors: {name}: {field} is not a list of non-negative integers")


class _GraphWriter:
    """Nodes and initializers of one graph; each node is named after its one output."""

    def __init__(self, weights: Weights) -> None:
        self._weights = weights
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._names: set[str] = set()

    def constant(self, name: str, array: NDArray[Any]) -> str:
        """Add ``array`` as an initializer once; later calls with the same name reuse it."""
        if name not in self._names:
            self._names.add(name)
            self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def checkpoint(self, name: str, shape: tuple[int, ...]) -> NDArray[np.float32]:
        """A float32 checkpoint tensor, checked against the shape the config implies."""
        array = self._weights.get(name)
        if array is None or array.shape != shape or array.dtype != np.float32:
            got = None if array is None else (array.shape, array.dtype)
            raise ValueError(f"weights: {name} should be float32 {shape}, got {got}")
        return array

    def weight(self, name: str, shape: tuple[int, ...], *, transpose: bool = False) -> str:
        """A checkpoint tensor as an initializer, transposed once if asked."""
        array = self.checkpoint(name, shape)
        return self.constant(f"{name}.T" if transpose else name, array.T if transpose else array)

    def node(self, op_type: str, inputs: Sequence[str], output: str, **attributes: Any) -> str:
        """Append one node and return its output's name."""
        self.nodes.append(
            helper.make_node(op_type, list(inputs), [output], name=output, **attributes)
        )
        return output


def sentence_encoder_model(config: BertConfig, weights: Weights) -> onnx.ModelProto:
    """The ONNX sentence encoder of ``config`` and ``weights`` (opset 17, IR version 8).

    Int64 ``input_ids`` and ``attention_mask`` [batch, sequence] in, float32 ``embedding``
    [batch, hidden_size] out (mean-pooled, L2-normalised). The same weights give
    byte-identical models.
    """
    g = _GraphWriter(weights)
    hidden = _embeddings(g, config)
    bias = _attention_bias(g)
    for layer in range(config.num_hidden_layers):
        hidden = _encoder_layer(g, config, f"encoder.layer.{layer}", hidden, bias)
    _pool_and_normalise(g, hidden)
    token_dims: list[str | int] = [_BATCH, _SEQUENCE]
    graph = helper.make_graph(
        g.nodes,
        "bert_sentence_encoder",
        [
            helper.make_tensor_value_info(INPUT_IDS, TensorProto.INT64, token_dims),
            helper.make_tensor_value_info(ATTENTION_MASK, TensorProto.INT64, token_dims),
        ],
        [helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, [_BATCH, config.hidden_size])],
        initializer=g.initializers,
    )
    return helper.make_model(
        graph,
        producer_name="spillway",
        opset_imports=[helper.make_opsetid("", ONNX_OPSET)],
        ir_version=ONNX_IR_VERSION,
    )


def _int64s(g: _GraphWriter, name: str, values: Sequence[int]) -> str:
    return g.constant(name, np.array(values, dtype=np.int64))


def _float(g: _GraphWriter, name: str, value: float) -> str:
    return g.constant(name, np.array(value, dtype=np.float32))


def _layer_norm(g: _GraphWriter, config: BertConfig, prefix: str, x: str) -> str:
    hidden = (config.hidden_size,)
    return g.node(
        "LayerNormalization",
        [x, g.weight(f"{prefix}.weight", hidden), g.weight(f"{prefix}.bias", hidden)],
        f"{prefix}/LayerNormalization",
        axis=-1,
        epsilon=config.layer_norm_eps,
    )


def _linear(g: _GraphWriter, prefix: str, x: str, width_in: int, width_out: int) -> str:
    # torch.nn.Linear stores [out, in]; the graph keeps [in, out] so MatMul reads it as is.
    weight = g.weight(f"{prefix}.weight", (width_out, width_in), transpose=True)
    product = g.node("MatMul", [x, weight], f"{prefix}/MatMul")
    return g.node("Add", [product, g.weight(f"{prefix}.bias", (width_out,))], f"{prefix}/Add")


def _embeddings(g: _GraphWriter, config: BertConfig) -> str:
    """Word + token type 0 + absolute position embeddings, then LayerNorm."""
    prefix = "embeddings"
    hidden = config.hidden_size
    words = g.weight(f"{prefix}.word_embeddings.weight", (config.vocab_size, hidden))
    word = g.node("Gather", [words, INPUT_IDS], f"{prefix}/word")
    # Every token is type 0, so its embedding is one row added to all positions.
    types = g.checkpoint(f"{prefix}.token_type_embeddings.weight", (config.type_vocab_size, hidden))
    type_zero = g.constant(f"{prefix}.token_type_embeddings.row0", types[0])
    typed = g.node("Add", [word, type_zero], f"{prefix}/typed")
    positions = g.weight(
        f"{prefix}.position_embeddings.weight", (config.max_position_embeddings, hidden)
    )
    length = g.node("Shape", [INPUT_IDS], f"{prefix}/sequence_length", start=1, end=2)
    zero = _int64s(g, "const.zeros1", [0])
    position = g.node("Slice", [positions, zero, length, zero], f"{prefix}/position")
    summed = g.node("Add", [typed, position], f"{prefix}/sum")
    return _layer_norm(g, config, f"{prefix}.LayerNorm", summed)


def _attention_bias(g: _GraphWriter) -> str:
    """[batch, 1, 1, sequence]: 0 where a key is attended, float32 min where it is padding."""
    keep = g.node("Cast", [ATTENTION_MASK], "mask/keep", to=TensorProto.BOOL)
    zero = _float(g, "const.zero", 0.0)
    masked = _float(g, "const.float32_min", float(np.finfo(np.float32).min))
    bias = g.node("Where", [keep, zero, masked], "mask/bias")
    return g.node("Unsqueeze", [bias, _int64s(g, "const.axes12", [1, 2])], "mask/bias4d")


def _encoder_layer(g: _GraphWriter, config: BertConfig, prefix: str, x: str, bias: str) -> str:
    """One post-LayerNorm transformer layer: self-attention, then the GELU feed-forward."""
    hidden, inner = config.hidden_size, config.intermediate_size
    attended = _self_attention(g, config, f"{prefix}.attention.self", x, bias)
    projected = _linear(g, f"{prefix}.attention.output.dense", attended, hidden, hidden)
    residual = g.node("Add", [projected, x], f"{prefix}.attention.output/residual")
    x = _layer_norm(g, config, f"{prefix}.attention.output.LayerNorm", residual)
    expanded = _linear(g, f"{prefix}.intermediate.dense", x, hidden, inner)
    activated = _gelu(g, f"{prefix}.intermediate/gelu", expanded)
    contracted = _linear(g, f"{prefix}.output.dense", activated, inner, hidden)
    residual = g.node("Add", [contracted, x], f"{prefix}.output/residual")
    return _layer_norm(g, config, f"{prefix}.output.LayerNorm", residual)


def _self_attention(g: _GraphWriter, config: BertConfig, prefix: str, x: str, bias: str) -> str:
    """Scaled dot-product attention over all heads; returns [batch, sequence, hidden]."""
    hidden = config.hidden_size
    heads = _int64s(g, "const.heads_shape", [0, 0, config.num_attention_heads, config.head_size])

    def split(name: str, perm: list[int]) -> str:
        # [batch, sequence, hidden] -> [batch, sequence, heads, head] -> permuted
        projected = _linear(g, f"{prefix}.{name}", x, hidden, hidden)
        per_head = g.node("Reshape", [projected, heads], f"{prefix}.{name}/heads")
        return g.node("Transpose", [per_head], f"{prefix}.{name}/transposed", perm=perm)

    query = split("query", [0, 2, 1, 3])  # [b, h, s, d]
    key = split("key", [0, 2, 3, 1])  # [b, h, d, s]: Kᵀ directly
    value = split("value", [0, 2, 1, 3])  # [b, h, s, d]
    scores = g.node("MatMul", [query, key], f"{prefix}/scores")
    scale = _float(g, "const.attention_scale", 1.0 / math.sqrt(config.head_size))
    scaled = g.node("Mul", [scores, scale], f"{prefix}/scaled")
    biased = g.node("Add", [scaled, bias], f"{prefix}/masked")
    probabilities = g.node("Softmax", [biased], f"{prefix}/probabilities", axis=-1)
    context = g.node("MatMul", [probabilities, value], f"{prefix}/context")
    merged = g.node("Transpose", [context], f"{prefix}/context_transposed", perm=[0, 2, 1, 3])
    flat = _int64s(g, "const.hidden_shape", [0, 0, hidden])
    return g.node("Reshape", [merged, flat], f"{prefix}/merged")


def _gelu(g: _GraphWriter, prefix: str, x: str) -> str:
    """Exact GELU, x * 0.5 * (1 + erf(x / √2)), in the order ORT's GeluFusion matches."""
    root2 = _float(g, "const.sqrt2", math.sqrt(2.0))
    erf = g.node("Erf", [g.node("Div", [x, root2], f"{prefix}/div")], f"{prefix}/erf")
    shifted = g.node("Add", [erf, _float(g, "const.one", 1.0)], f"{prefix}/add")
    product = g.node("Mul", [x, shifted], f"{prefix}/mul")
    return g.node("Mul", [product, _float(g, "const.half", 0.5)], f"{prefix}/half")


def _pool_and_normalise(g: _GraphWriter, hidden: str) -> str:
    """Mean over attended tokens (count clamped at 1e-9), then x / max(‖x‖₂, 1e-12)."""
    axis1 = _int64s(g, "const.axis1", [1])
    last = _int64s(g, "const.axis_last", [-1])
    unsqueezed = g.node("Unsqueeze", [ATTENTION_MASK, last], "pool/mask")
    mask = g.node("Cast", [unsqueezed], "pool/mask_float", to=TensorProto.FLOAT)
    masked = g.node("Mul", [hidden, mask], "pool/masked")
    summed = g.node("ReduceSum", [masked, axis1], "pool/sum", keepdims=0)
    counts = g.node("ReduceSum", [mask, axis1], "pool/count", keepdims=0)
    count_min = _float(g, "const.count_min", POOLED_COUNT_MIN)
    clamped = g.node("Clip", [counts, count_min], "pool/count_min")
    mean = g.node("Div", [summed, clamped], "pool/mean")
    norm = g.node("ReduceL2", [mean], "normalise/norm", axes=[1], keepdims=1)
    norm_min = _float(g, "const.norm_min", NORM_MIN)
    floor = g.node("Clip", [norm, norm_min], "normalise/norm_min")
    return g.node("Div", [mean, floor], OUTPUT)
