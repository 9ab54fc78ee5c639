"""What the OpenAI-compatible door's unit tests share: a small model repository in a
folder (a text_embedding model, an image classifier, a text model that takes no batch),
and the V2 answer a backend gives for an embeddings request."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

DIMENSIONS = 4
MAX_BATCH = 8


def _tensor(name: str, data_type: str, dims: list[int]) -> dict[str, Any]:
    return {"name": name, "data_type": data_type, "dims": dims}


def embedder_config(name: str = "minilm", *, max_batch_size: int = MAX_BATCH) -> dict[str, Any]:
    """A text_embedding model's ``config.json``: one text per row in, one vector out."""
    return {
        "name": name,
        "max_batch_size": max_batch_size,
        "input": [_tensor("text", "TYPE_STRING", [1])],
        "output": [_tensor("embedding", "TYPE_FP32", [DIMENSIONS])],
        "spillway": {
            "kind": "text_embedding",
            "tokenizer_file": "tokenizer.json",
            "max_sequence_length": 16,
        },
    }


def classifier_config(name: str = "digits") -> dict[str, Any]:
    """An image classifier's ``config.json``."""
    return {
        "name": name,
        "max_batch_size": 64,
        "input": [_tensor("image", "TYPE_FP32", [8, 8])],
        "output": [_tensor("probabilities", "TYPE_FP32", [10])],
        "spillway": {"kind": "image_classifier"},
    }


def publish(root: Path, config: dict[str, Any], *, versions: int = 1) -> None:
    """``config`` as a model of the repository at ``root``, with committed versions."""
    folder = root / config["name"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    for version in range(1, versions + 1):
        files = folder / str(version)
        files.mkdir(exist_ok=True)
        graph = b"not a graph: the router reads no graph"
        (files / "model.onnx").write_bytes(graph)
        digest = hashlib.sha256(graph).hexdigest()
        (files / "SHA256SUMS").write_text(f"{digest}  model.onnx\n")


def repository(root: Path) -> Path:
    """minilm, digits and a text model without batching, in ``root``."""
    publish(root, embedder_config())
    publish(root, classifier_config())
    publish(root, embedder_config("single", max_batch_size=0))
    return root


def vector(row: int) -> list[float]:
    """The vector a fake backend gives row ``row``: exact in float32."""
    return [row + 0.25, -0.5, 1.0 / (row + 2), 0.125 * row]


def v2_answer(rows: int, *, tokens: int | None = 7, shape: list[int] | None = None) -> bytes:
    """A backend's V2 answer to an embeddings request of ``rows`` texts."""
    document: dict[str, Any] = {
        "model_name": "minilm",
        "model_version": "1",
        "outputs": [
            {
                "name": "embedding",
                "datatype": "FP32",
                "shape": shape or [rows, DIMENSIONS],
                "data": [x for row in range(rows) for x in vector(row)],
            }
        ],
    }
    if tokens is not None:
        document["parameters"] = {"token_count": tokens}
    return json.dumps(document).encode()
