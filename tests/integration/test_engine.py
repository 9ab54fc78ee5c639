"""The core engine on the real models: batching equivalence and input validation."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from spillway.models.config import ModelConfig
from spillway.models.engine import CPU, CUDA, EngineOptions, OnnxModel
from spillway.protocol.errors import (
    BatchTooLargeError,
    InvalidInputError,
    ModelLoadError,
    PayloadTooLargeError,
    SpillwayError,
)
from tests.support import load_engine

SENTENCES = [
    "Short one.",
    "A considerably longer sentence that carries many more tokens than the first one does.",
    "Ünïcödé text, with punctuation!",
    "The quick brown fox jumps over the lazy dog.",
    "ok",
]


@pytest.fixture(scope="module")
def digits(models_dir: Path) -> OnnxModel:
    return load_engine(models_dir, "digits")


@pytest.fixture(scope="module")
def minilm(models_dir: Path) -> OnnxModel:
    return load_engine(models_dir, "minilm")


@pytest.fixture(scope="module")
def images(models_dir: Path) -> np.ndarray:
    return np.load(models_dir / "digits" / "samples" / "images.npy").astype(np.float32)  # type: ignore[no-any-return]


def _texts(sentences: list[str]) -> np.ndarray:
    return np.array([[s.encode()] for s in sentences], dtype=np.object_)


def test_digits_batch_equals_single_runs(digits: OnnxModel, images: np.ndarray) -> None:
    # GIVEN 17 held-out images
    batch = images[:17]
    # WHEN they run as one batch and one by one
    together = digits.infer({"image": batch})
    alone = [digits.infer({"image": batch[i : i + 1]}) for i in range(len(batch))]
    # THEN every row is the same
    np.testing.assert_array_equal(together["label"], np.concatenate([a["label"] for a in alone]))
    np.testing.assert_allclose(
        together["probabilities"], np.concatenate([a["probabilities"] for a in alone]), atol=1e-6
    )
    assert together["label"].shape == (17, 1)
    np.testing.assert_allclose(together["probabilities"].sum(axis=1), 1.0, atol=1e-5)


def test_digits_accuracy_through_engine(
    digits: OnnxModel, images: np.ndarray, models_dir: Path
) -> None:
    labels = np.load(models_dir / "digits" / "samples" / "labels.npy")
    predicted = np.concatenate(
        [
            digits.infer({"image": images[i : i + 64]})["label"][:, 0]
            for i in range(0, len(images), 64)
        ]
    )
    assert (predicted == labels).mean() >= 0.95


def test_minilm_batch_of_mixed_lengths_equals_single_runs(minilm: OnnxModel) -> None:
    # GIVEN sentences of very different token lengths
    # WHEN embedded together (padded to the longest) and alone
    together = minilm.infer({"text": _texts(SENTENCES)})["embedding"]
    alone = np.concatenate([minilm.infer({"text": _texts([s])})["embedding"] for s in SENTENCES])
    # THEN padding changes nothing and embeddings are unit length
    np.testing.assert_allclose(together, alone, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-5)
    assert together.shape == (len(SENTENCES), 384)


def test_minilm_similarity_is_meaningful(minilm: OnnxModel) -> None:
    emb = minilm.infer(
        {
            "text": _texts(
                [
                    "A cat sits on the mat.",
                    "A kitten rests on a rug.",
                    "Stock markets fell sharply.",
                ]
            )
        }
    )["embedding"]
    assert emb[0] @ emb[1] > emb[0] @ emb[2] + 0.2


def test_run_splits_rows_per_request(digits: OnnxModel, images: np.ndarray) -> None:
    # GIVEN three prepared requests of 1, 3 and 2 rows
    sizes = [1, 3, 2]
    spans = list(zip(np.cumsum([0, *sizes])[:-1], sizes, strict=True))
    prepared = [digits.prepare({"image": images[s : s + n]}) for s, n in spans]
    # WHEN they run as one batch
    results = digits.run(prepared)
    # THEN each gets exactly its own rows
    for (s, n), result in zip(spans, results, strict=True):
        expected = digits.infer({"image": images[s : s + n]})
        np.testing.assert_array_equal(result["label"], expected["label"])


@pytest.mark.parametrize(
    ("inputs", "error", "code"),
    [
        ({"pixels": np.zeros((1, 8, 8), np.float32)}, InvalidInputError, "invalid_input"),
        ({}, InvalidInputError, "invalid_input"),
        ({"image": np.zeros((1, 8, 8), np.float64)}, InvalidInputError, "invalid_input"),
        ({"image": np.zeros((1, 64), np.float32)}, InvalidInputError, "invalid_input"),
        ({"image": np.zeros((1, 8, 9), np.float32)}, InvalidInputError, "invalid_input"),
        ({"image": np.zeros((0, 8, 8), np.float32)}, InvalidInputError, "invalid_input"),
        ({"image": np.zeros((65, 8, 8), np.float32)}, BatchTooLargeError, "batch_too_large"),
    ],
    ids=["unknown-name", "missing", "wrong-dtype", "wrong-rank", "wrong-dim", "empty", "too-big"],
)
def test_digits_rejects_bad_input(
    digits: OnnxModel, inputs: dict[str, np.ndarray], error: type[SpillwayError], code: str
) -> None:
    with pytest.raises(error) as caught:
        digits.prepare(inputs)
    assert caught.value.code == code
    assert caught.value.status == 400


@pytest.mark.parametrize(
    ("texts", "code"),
    [([b""], "invalid_input"), ([b"   "], "invalid_input"), ([b"\xff\xfe"], "invalid_input")],
    ids=["empty", "blank", "bad-utf8"],
)
def test_minilm_rejects_bad_text(minilm: OnnxModel, texts: list[bytes], code: str) -> None:
    with pytest.raises(InvalidInputError) as caught:
        minilm.prepare({"text": np.array([[t] for t in texts], dtype=np.object_)})
    assert caught.value.code == code


def test_caps_give_413(models_dir: Path) -> None:
    model = load_engine(
        models_dir, "minilm", EngineOptions(max_bytes_per_element=16, max_elements_per_input=4)
    )
    with pytest.raises(PayloadTooLargeError):
        model.prepare({"text": _texts(["this sentence is longer than sixteen bytes"])})
    with pytest.raises(PayloadTooLargeError):
        model.prepare({"text": _texts(["a"] * 5)})


def test_metadata_has_leading_batch_dim(digits: OnnxModel) -> None:
    meta = digits.metadata()
    assert meta["inputs"] == [{"name": "image", "datatype": "FP32", "shape": [-1, 8, 8]}]
    assert {o["name"]: o["shape"] for o in meta["outputs"]} == {
        "label": [-1, 1],
        "probabilities": [-1, 10],
    }
    assert meta["parameters"]["execution_provider"] == CPU


def test_cuda_request_without_cuda_is_loud(
    models_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # GIVEN a machine without CUDA (the GPU test tier covers the other case)
    import onnxruntime as ort

    if CUDA in ort.get_available_providers():
        pytest.skip("CUDA is present here")
    # WHEN CUDA is asked for
    with caplog.at_level(logging.WARNING, logger="spillway.engine"):
        model = load_engine(models_dir, "digits", EngineOptions(providers=(CUDA, CPU)))
    # THEN it runs on the CPU and says so in the log and the metadata
    assert model.provider == CPU
    assert model.provider_fallback
    assert model.metadata()["parameters"]["provider_fallback"] is True
    assert any("CUDA was requested" in r.message for r in caplog.records)


def test_corrupt_onnx_file_is_a_load_error(models_dir: Path, tmp_path: Path) -> None:
    version_dir = tmp_path / "1"
    shutil.copytree(models_dir / "digits" / "1", version_dir)
    (version_dir / "model.onnx").write_bytes(b"not an onnx model")
    config = ModelConfig.model_validate_json((models_dir / "digits" / "config.json").read_bytes())
    with pytest.raises(ModelLoadError):
        OnnxModel("digits", 1, config, version_dir, EngineOptions())


def _two_input_model(tmp_path: Path) -> tuple[ModelConfig, Path]:
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, [None, 3])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, [None, 3])
    out = helper.make_tensor_value_info("sum", TensorProto.FLOAT, [None, 3])
    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["sum"])], "add", [a, b], [out])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "model.onnx")
    spec = {"data_type": "TYPE_FP32", "dims": [3]}
    config = ModelConfig(
        name="add",
        max_batch_size=8,
        input=[{"name": "a", **spec}, {"name": "b", **spec}],
        output=[{"name": "sum", **spec}],
    )
    return config, tmp_path


def test_inputs_must_agree_on_batch_size(tmp_path: Path) -> None:
    config, path = _two_input_model(tmp_path)
    model = OnnxModel("add", 1, config, path, EngineOptions())
    ones = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(model.infer({"a": ones, "b": ones})["sum"], ones * 2)
    with pytest.raises(InvalidInputError, match="same batch size"):
        model.prepare({"a": ones, "b": np.ones((3, 3), np.float32)})


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (("a",), "missing input 'b' for model add; its inputs: 'a', 'b'"),
        (("a", "c"), "unknown input 'c' for model add; its inputs: 'a', 'b'"),
        (("a", "b", "B"), "unknown input 'B' for model add; its inputs: 'a', 'b'"),
    ],
    ids=["missing", "unknown", "one-too-many"],
)
def test_a_wrong_input_name_is_refused_naming_the_inputs(
    tmp_path: Path, names: tuple[str, ...], message: str
) -> None:
    # GIVEN a model with inputs a and b
    config, path = _two_input_model(tmp_path)
    model = OnnxModel("add", 1, config, path, EngineOptions())
    # WHEN a request names its inputs wrongly
    with pytest.raises(InvalidInputError) as caught:
        model.prepare({name: np.ones((1, 3), np.float32) for name in names})
    # THEN the 400 keeps its code and names the inputs the model has
    assert (caught.value.code, caught.value.message) == ("invalid_input", message)


def test_config_that_disagrees_with_graph_fails_to_load(tmp_path: Path) -> None:
    config, path = _two_input_model(tmp_path)
    wrong = config.model_copy(update={"input": config.input[:1]})
    with pytest.raises(ModelLoadError, match="do not match"):
        OnnxModel("add", 1, wrong, path, EngineOptions())
