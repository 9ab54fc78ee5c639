"""A plain numpy forward pass of the BERT sentence encoder, to check the ONNX graph against.

It follows Hugging Face's ``BertModel`` (eager attention) and sentence-transformers'
mean pooling + ``Normalize`` step by step in float32, reading the checkpoint's own
tensors (Linear weights ``[out, in]``); it shares no code with the graph it checks.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:
    from spillway_cli.modelbuild.bert_graph import BertConfig, Weights

F32 = NDArray[np.float32]

# numpy has no erf; math.erf is correct to double precision, which is plenty for a reference.
_ERF = np.frompyfunc(math.erf, 1, 1)


def sentence_embeddings(
    config: BertConfig,
    weights: Weights,
    input_ids: NDArray[np.int64],
    attention_mask: NDArray[np.int64],
) -> F32:
    """Mean-pooled, L2-normalised embeddings ``[batch, hidden]`` of a padded token batch."""
    if input_ids.shape != attention_mask.shape or input_ids.ndim != 2:
        raise ValueError(f"token batch shapes {input_ids.shape} and {attention_mask.shape}")
    hidden = _embeddings(config, weights, input_ids)
    # Hugging Face's padding mask: add float32 min to the scores of padded keys.
    bias = np.where(attention_mask != 0, np.float32(0.0), np.finfo(np.float32).min)
    bias = bias.astype(np.float32)[:, None, None, :]
    for layer in range(config.num_hidden_layers):
        hidden = _encoder_layer(config, weights, f"encoder.layer.{layer}", hidden, bias)
    return _mean_pool_and_normalise(hidden, attention_mask)


def _embeddings(config: BertConfig, w: Weights, input_ids: NDArray[np.int64]) -> F32:
    sequence = input_ids.shape[1]
    words = w["embeddings.word_embeddings.weight"][input_ids]
    token_type = w["embeddings.token_type_embeddings.weight"][0]
    positions = w["embeddings.position_embeddings.weight"][:sequence]
    summed = words + token_type + positions
    return _layer_norm(config, w, "embeddings.LayerNorm", summed)


def _encoder_layer(config: BertConfig, w: Weights, prefix: str, x: F32, bias: F32) -> F32:
    attended = _self_attention(config, w, f"{prefix}.attention.self", x, bias)
    projected = _linear(w, f"{prefix}.attention.output.dense", attended)
    x = _layer_norm(config, w, f"{prefix}.attention.output.LayerNorm", projected + x)
    inner = _gelu(_linear(w, f"{prefix}.intermediate.dense", x))
    out = _linear(w, f"{prefix}.output.dense", inner)
    return _layer_norm(config, w, f"{prefix}.output.LayerNorm", out + x)


def _self_attention(config: BertConfig, w: Weights, prefix: str, x: F32, bias: F32) -> F32:
    batch, sequence, hidden = x.shape
    heads, head_size = config.num_attention_heads, config.head_size

    def split(name: str) -> F32:
        # [batch, sequence, hidden] -> [batch, heads, sequence, head_size]
        projected = _linear(w, f"{prefix}.{name}", x)
        return projected.reshape(batch, sequence, heads, head_size).transpose(0, 2, 1, 3)

    query, key, value = split("query"), split("key"), split("value")
    scores = (query @ key.transpose(0, 1, 3, 2)) * np.float32(1.0 / math.sqrt(head_size))
    probabilities = _softmax(scores + bias)
    context = probabilities @ value
    return context.transpose(0, 2, 1, 3).reshape(batch, sequence, hidden)


def _linear(w: Weights, prefix: str, x: F32) -> F32:
    result: F32 = x @ w[f"{prefix}.weight"].T + w[f"{prefix}.bias"]
    return result


def _layer_norm(config: BertConfig, w: Weights, prefix: str, x: F32) -> F32:
    mean = x.mean(axis=-1, keepdims=True)
    variance = np.square(x - mean).mean(axis=-1, keepdims=True)
    normalised = (x - mean) / np.sqrt(variance + np.float32(config.layer_norm_eps))
    result: F32 = normalised * w[f"{prefix}.weight"] + w[f"{prefix}.bias"]
    return result


def _gelu(x: F32) -> F32:
    erf = np.asarray(_ERF(x.astype(np.float64) / math.sqrt(2.0)), dtype=np.float32)
    result: F32 = np.float32(0.5) * x * (np.float32(1.0) + erf)
    return result


def _softmax(x: F32) -> F32:
    shifted = np.exp(x - x.max(axis=-1, keepdims=True))
    result: F32 = shifted / shifted.sum(axis=-1, keepdims=True)
    return result


def _mean_pool_and_normalise(hidden: F32, attention_mask: NDArray[np.int64]) -> F32:
    mask = attention_mask.astype(np.float32)[:, :, None]
    counts = np.maximum(mask.sum(axis=1), np.float32(1e-9))
    mean = (hidden * mask).sum(axis=1) / counts
    norm = np.maximum(np.linalg.norm(mean, axis=1, keepdims=True), np.float32(1e-12))
    result: F32 = (mean / norm).astype(np.float32)
    return result
