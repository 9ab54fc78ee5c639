"""The model builders write a servable repository: real ONNX Runtime on the built files.

digits and mlp-bench are built fresh (seconds). minilm is read from ``SPILLWAY_MODELS_DIR``
when that repository already holds it (``make models`` builds it), else built here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper
from tokenizers import Tokenizer

from spillway.models.config import ModelConfig
from spillway_cli.modelbuild.build import build_repository

FRESH_MODELS = ("digits", "mlp-bench")
ALL_MODELS = (*FRESH_MODELS, "minilm")
CHECKSUM_LINE = re.compile(r"^([0-9a-f]{64})  (\S.*)$")

# Different from the builder's own verification sentences.
TEST_SENTENCES = [
    "Where is the nearest train station?",
    "Serverless inference scales to zero when nobody is asking.",
    "A queue that never says no eventually says nothing at all: bound it, measure the wait, "
    "and shed load with a clear 429 before the tail latency of every other caller explodes.",
    "Les élèves étudient l'apprentissage automatique à Montréal — 北京欢迎你",
    "?",
]


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="session")
def fresh_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("repo")
    build_repository(out, list(FRESH_MODELS))
    return out


@pytest.fixture(scope="session")
def minilm_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    prebuilt = os.environ.get("SPILLWAY_MODELS_DIR")
    if prebuilt and (Path(prebuilt) / "minilm" / "config.json").is_file():
        return Path(prebuilt)
    out = tmp_path_factory.mktemp("minilm-repo")
    build_repository(out, ["minilm"])
    return out


@pytest.fixture
def repo_for(request: pytest.FixtureRequest) -> Callable[[str], Path]:
    """The repository holding ``model``, without building minilm for tests that skip it."""

    def resolve(model: str) -> Path:
        repo: Path = request.getfixturevalue("minilm_repo" if model == "minilm" else "fresh_repo")
        return repo

    return resolve


@pytest.fixture(scope="session")
def minilm_session(minilm_repo: Path) -> ort.InferenceSession:
    return _session(minilm_repo / "minilm" / "1" / "model.onnx")


@pytest.fixture(scope="session")
def minilm_tokenizer(minilm_repo: Path) -> Tokenizer:
    return Tokenizer.from_file(str(minilm_repo / "minilm" / "1" / "tokenizer.json"))


def _embed(session: ort.InferenceSession, tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    encodings = tokenizer.encode_batch(texts)
    ids = np.array([e.ids for e in encodings], dtype=np.int64)
    mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
    (embedding,) = session.run(["embedding"], {"input_ids": ids, "attention_mask": mask})
    return np.asarray(embedding, dtype=np.float32)


def test_digits_accuracy_through_onnx_runtime(fresh_repo: Path) -> None:
    # GIVEN the held-out samples written beside the digits model
    samples = fresh_repo / "digits" / "samples"
    images = np.load(samples / "images.npy", allow_pickle=False)
    labels = np.load(samples / "labels.npy", allow_pickle=False)
    session = _session(fresh_repo / "digits" / "1" / "model.onnx")

    # WHEN they are flattened (as the engine does) and run through ONNX Runtime
    label, probabilities = session.run(
        ["label", "probabilities"], {"input": images.reshape(len(images), 64)}
    )

    # THEN the samples look like the dataset and the model is accurate and well-formed
    assert images.dtype == np.float32
    assert images.shape[1:] == (8, 8)
    assert images.min() == 0.0
    assert images.max() == 16.0
    assert labels.dtype == np.int64
    assert labels.shape == (len(images),)
    assert set(np.unique(labels)) == set(range(10))
    assert label.dtype == np.int64
    assert label.shape == (len(images), 1)
    assert probabilities.dtype == np.float32
    assert probabilities.shape == (len(images), 10)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, atol=1e-5)
    assert np.array_equal(probabilities.argmax(axis=1), label[:, 0])
    assert float(np.mean(label[:, 0] == labels)) >= 0.95


def test_digits_onnx_signature(fresh_repo: Path) -> None:
    # GIVEN the built digits model
    # WHEN ONNX Runtime loads it
    session = _session(fresh_repo / "digits" / "1" / "model.onnx")

    # THEN it has one dynamic-batch input and exactly the two served outputs
    inputs = [(i.name, i.type, i.shape[1:]) for i in session.get_inputs()]
    outputs = [(o.name, o.type, o.shape[1:]) for o in session.get_outputs()]
    assert inputs == [("input", "tensor(float)", [64])]
    assert outputs == [("label", "tensor(int64)", [1]), ("probabilities", "tensor(float)", [10])]
    assert all(isinstance(o.shape[0], str) for o in session.get_outputs())


def test_mlp_output_matches_numpy_for_any_batch(fresh_repo: Path) -> None:
    # GIVEN the mlp-bench model and its weights read back from the file
    path = fresh_repo / "mlp-bench" / "1" / "model.onnx"
    weights = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    session = _session(path)
    rng = np.random.default_rng(7)

    for batch in (1, 5):
        # WHEN a batch is run
        x = rng.standard_normal((batch, 1024), dtype=np.float32)
        (got,) = session.run(["output"], {"input": x})

        # THEN it equals three affine layers with ReLU between, and activations stay O(1)
        h = x
        for i in range(3):
            h = h @ weights[f"w{i}"] + weights[f"b{i}"]
            h = np.maximum(h, 0.0) if i < 2 else h
        assert got.shape == (batch, 1024)
        np.testing.assert_allclose(got, h, atol=1e-4)
        assert 0.05 < float(np.std(got)) < 5.0


def test_mlp_builds_are_byte_identical(fresh_repo: Path, tmp_path: Path) -> None:
    # GIVEN mlp-bench already built in the session repository
    first = fresh_repo / "mlp-bench" / "1" / "model.onnx"

    # WHEN it is built again into another directory
    report = build_repository(tmp_path, ["mlp-bench"])["mlp-bench"]

    # THEN both files have the same digest, which the report states
    second = tmp_path / "mlp-bench" / "1" / "model.onnx"
    assert hashlib.sha256(first.read_bytes()).hexdigest() == report.sha256
    assert first.read_bytes() == second.read_bytes()
    assert report.size_bytes == second.stat().st_size


def test_rebuild_overwrites_and_leaves_nothing_behind(tmp_path: Path) -> None:
    # GIVEN a built model whose version directory gained a stray file
    build_repository(tmp_path, ["mlp-bench"])
    stray = tmp_path / "mlp-bench" / "1" / "stale.bin"
    stray.write_bytes(b"left over")

    # WHEN it is rebuilt into the same repository
    build_repository(tmp_path, ["mlp-bench"])

    # THEN the old directory was replaced whole and no staging directories remain
    assert not stray.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp-bench"]
    assert sorted(p.name for p in (tmp_path / "mlp-bench" / "1").iterdir()) == [
        "SHA256SUMS",
        "model.onnx",
    ]


def test_unknown_model_name_is_refused(tmp_path: Path) -> None:
    # GIVEN / WHEN an unknown model is requested / THEN nothing is built
    with pytest.raises(ValueError, match="unknown model"):
        build_repository(tmp_path / "repo", ["digits", "no-such-model"])
    assert not (tmp_path / "repo").exists()


@pytest.mark.parametrize("model", ALL_MODELS)
def test_checksums_cover_every_file(model: str, repo_for: Callable[[str], Path]) -> None:
    # GIVEN a built version directory
    version_dir = repo_for(model) / model / "1"

    # WHEN SHA256SUMS is parsed
    lines = (version_dir / "SHA256SUMS").read_text(encoding="utf-8").splitlines()
    parsed = [CHECKSUM_LINE.fullmatch(line) for line in lines]

    # THEN it lists every other file once, sorted, with its true digest
    assert all(parsed)
    names = [m.group(2) for m in parsed if m]
    files = sorted(p.name for p in version_dir.iterdir() if p.name != "SHA256SUMS")
    assert names == files
    for m in parsed:
        assert m
        assert hashlib.sha256((version_dir / m.group(2)).read_bytes()).hexdigest() == m.group(1)
    if model == "minilm":
        assert "tokenizer.json" in names


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="sha256sum not installed")
def test_checksums_pass_sha256sum_check(fresh_repo: Path) -> None:
    # GIVEN / WHEN coreutils checks the digits version directory
    result = subprocess.run(
        ["sha256sum", "--check", "--strict", "SHA256SUMS"],
        cwd=fresh_repo / "digits" / "1",
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )

    # THEN every file verifies
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "model.onnx: OK"


EXPECTED_CONFIG = {
    "digits": ("image_classifier", 64, [("image", "TYPE_FP32", (8, 8))], (16, 32), 256),
    "mlp-bench": ("tensor", 256, [("input", "TYPE_FP32", (1024,))], (32, 64, 128), 1024),
    "minilm": ("text_embedding", 64, [("text", "TYPE_STRING", (1,))], (16, 32, 64), 512),
}
EXPECTED_OUTPUTS = {
    "digits": [("label", "TYPE_INT64", (1,)), ("probabilities", "TYPE_FP32", (10,))],
    "mlp-bench": [("output", "TYPE_FP32", (1024,))],
    "minilm": [("embedding", "TYPE_FP32", (384,))],
}


@pytest.mark.parametrize("model", ALL_MODELS)
def test_config_json_validates(model: str, repo_for: Callable[[str], Path]) -> None:
    # GIVEN a built model's config.json
    text = (repo_for(model) / model / "config.json").read_text(encoding="utf-8")

    # WHEN the core parses it
    config = ModelConfig.model_validate_json(text)

    # THEN it is the served signature, written with indent 2
    kind, max_batch, inputs, preferred, queue_size = EXPECTED_CONFIG[model]
    assert text == json.dumps(json.loads(text), indent=2) + "\n"
    assert config.name == model
    assert config.spillway.kind == kind
    assert config.max_batch_size == max_batch
    assert [(t.name, t.data_type, t.dims) for t in config.input] == inputs
    assert [(t.name, t.data_type, t.dims) for t in config.output] == EXPECTED_OUTPUTS[model]
    assert config.dynamic_batching is not None
    assert config.dynamic_batching.preferred_batch_size == preferred
    assert config.dynamic_batching.default_queue_policy.max_queue_size == queue_size


def test_minilm_config_has_tokenizer_and_buckets(minilm_repo: Path) -> None:
    # GIVEN / WHEN the minilm config is parsed
    config = ModelConfig.model_validate_json((minilm_repo / "minilm" / "config.json").read_text())

    # THEN it names the tokenizer shipped in the version directory and the length buckets
    assert config.spillway.tokenizer_file == "tokenizer.json"
    assert (minilm_repo / "minilm" / "1" / config.spillway.tokenizer_file).is_file()
    assert config.spillway.max_sequence_length == 256
    assert config.spillway.length_buckets == (16, 32, 64, 128, 256)


def test_minilm_tokenizer_is_configured_for_serving(minilm_tokenizer: Tokenizer) -> None:
    # GIVEN the saved tokenizer
    # WHEN a very long and a short text are encoded together
    long_text = "token " * 1000
    long, short = minilm_tokenizer.encode_batch([long_text, "hi"])

    # THEN the long one is truncated to 256 and the short one padded with id 0
    assert len(long.ids) == 256
    assert long.ids[-1] == 102  # [SEP] survives truncation
    assert len(short.ids) == 256
    assert short.ids[3:] == [0] * 253
    assert short.attention_mask[:3] == [1, 1, 1]
    assert sum(short.attention_mask) == 3


def test_minilm_onnx_signature_and_unit_norm(
    minilm_session: ort.InferenceSession, minilm_tokenizer: Tokenizer
) -> None:
    # GIVEN the minilm ONNX session
    # WHEN a batch of texts is embedded
    embedding = _embed(minilm_session, minilm_tokenizer, TEST_SENTENCES)

    # THEN the inputs are int64 [batch, sequence] and each embedding has length 1
    assert [(i.name, i.type, len(i.shape)) for i in minilm_session.get_inputs()] == [
        ("input_ids", "tensor(int64)", 2),
        ("attention_mask", "tensor(int64)", 2),
    ]
    assert embedding.shape == (len(TEST_SENTENCES), 384)
    assert embedding.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(embedding, axis=1), 1.0, atol=1e-5)


def test_minilm_variable_sequence_length(
    minilm_session: ort.InferenceSession, minilm_tokenizer: Tokenizer
) -> None:
    # GIVEN two texts of different token lengths
    texts = ["short one", TEST_SENTENCES[2]]
    lengths = [len(minilm_tokenizer.encode(t).ids) for t in texts]
    assert lengths[0] < lengths[1]

    # WHEN they are embedded as one padded batch and one at a time
    batched = _embed(minilm_session, minilm_tokenizer, texts)
    alone = np.concatenate([_embed(minilm_session, minilm_tokenizer, [t]) for t in texts])

    # THEN padding does not change the result
    np.testing.assert_allclose(batched, alone, atol=1e-5, rtol=0)
