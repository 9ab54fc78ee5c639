"""``spillway models add`` on real ONNX graphs built here, loaded by the servers' loader
and compared with ONNX Runtime run directly; a folder holding only ``model.onnx`` served
by the GPU service in this process."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer, models, pre_tokenizers
from typer.testing import CliRunner

from gpu_service.dataplane import DataPlane
from gpu_service.http import GpuServiceApp
from gpu_service.registry import ModelRegistry
from gpu_service.settings import GpuSettings
from spillway.models.engine import EngineOptions, OnnxModel
from spillway.models.repository import LocalRepository, ModelRepository, open_repository
from spillway_cli.main import app
from tests import graphs
from tests.support import gpu_service

# A p99 target every profile on a loaded 2-core runner meets up to batch 32, for the tests
# whose point is not the choice: with the 50 ms default a stall in batch 1's 20 timed runs
# chose max_batch_size 1 (CI), and a batch of 2 was then refused. The choice itself is
# tested on given tables in tests/unit/test_onboarding.py.
ROOMY_P99 = ("--p99-ms", "5000")
WORDS = ["[PAD]", "[UNK]", "spillway", "serves", "your", "own", "model", "fast"]


def add(tmp_path: Path, model: Path, name: str, *extra: str) -> tuple[int, str]:
    """``spillway models add`` into ``tmp_path/repo``; its exit code and output."""
    argv = ["models", "add", str(model), "--name", name, "--repository", str(tmp_path / "repo")]
    result = CliRunner().invoke(app, [*argv, *extra], catch_exceptions=False)
    return result.exit_code, result.output


def served(repository: ModelRepository, name: str, cache: Path) -> OnnxModel:
    """The newest version as the servers load it (checksums verified)."""
    config = repository.read_config(name)
    version = repository.list_versions(name)[-1]
    path = repository.fetch_version(name, version, cache)
    return OnnxModel(name, version, config, path, EngineOptions())


def direct(model: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The graph run by ONNX Runtime itself, the reference for every served answer."""
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return list(session.run(None, feeds))


def config_json(tmp_path: Path, name: str) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((tmp_path / "repo" / name / "config.json").read_text())
    return document


def test_a_dynamic_batch_model_is_proven_profiled_and_served(tmp_path: Path) -> None:
    # GIVEN a dense layer with a dynamic batch dimension
    model = graphs.dense(tmp_path / "dense.onnx")
    # WHEN it is added with a p99 target
    code, output = add(tmp_path, model, "dense", *ROOMY_P99)
    # THEN the proof, the profile table and the choice are printed
    assert code == 0, output
    assert "batch-safe: a batch of 8 equals its 8 single-row runs" in output
    assert "batch    p50 ms    p99 ms     rows/s" in output
    assert "chosen: max_batch_size 32" in output  # a tiny graph fits batch 32 in 5 s
    # AND the configuration batches up to the choice, dims without the batch dimension
    document = config_json(tmp_path, "dense")
    assert document["max_batch_size"] == 32
    assert document["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}]
    assert document["output"] == [{"name": "y", "data_type": "TYPE_FP32", "dims": [3]}]
    assert document["dynamic_batching"]["preferred_batch_size"] == [8, 32]
    # AND the version loads verified and answers as the graph does
    repository = LocalRepository(tmp_path / "repo")
    assert repository.list_versions("dense") == [1]
    sums = (tmp_path / "repo" / "dense" / "1" / "SHA256SUMS").read_text().split()
    assert sums[1] == "model.onnx"
    x = np.random.default_rng(3).standard_normal((5, 4)).astype(np.float32)
    answer = served(repository, "dense", tmp_path)
    np.testing.assert_allclose(answer.infer({"x": x})["y"], x @ graphs.WEIGHTS, rtol=1e-6)


def test_a_fixed_batch_of_one_is_not_batched(tmp_path: Path) -> None:
    # GIVEN a graph whose batch dimension is fixed at 1 WHEN added
    model = graphs.dense(tmp_path / "one.onnx", batch=1)
    code, output = add(tmp_path, model, "one", "--version", "3")
    # THEN max_batch_size 0, dims the whole shape, no profile, the version asked for
    assert code == 0, output
    assert "no dynamic batch dimension" in output
    assert "p50 ms" not in output
    document = config_json(tmp_path, "one")
    assert document["max_batch_size"] == 0
    assert "dynamic_batching" not in document
    assert document["input"][0]["dims"] == [1, 4]
    repository = LocalRepository(tmp_path / "repo")
    assert repository.list_versions("one") == [3]
    x = np.ones((1, 4), np.float32)
    assert served(repository, "one", tmp_path).infer({"x": x})["y"].tolist() == (
        direct(model, {"x": x})[0].tolist()
    )
    # AND adding version 3 again is refused in one line
    code, output = add(tmp_path, model, "one", "--version", "3")
    assert code == 1
    assert output.strip() == "error: model 'one' already has version 3"


def test_a_model_that_mixes_rows_is_never_batched(tmp_path: Path) -> None:
    # GIVEN a model that subtracts the batch's mean (over axis 0) WHEN added
    model = graphs.centred(tmp_path / "centred.onnx")
    code, output = add(tmp_path, model, "centred")
    # THEN it says so in one line and writes max_batch_size 0 without a batcher
    assert code == 0, output
    refusal = [line for line in output.splitlines() if line.startswith("not batch-safe")]
    assert len(refusal) == 1
    assert "mixes rows across the batch" in refusal[0]
    document = config_json(tmp_path, "centred")
    assert document["max_batch_size"] == 0
    assert "dynamic_batching" not in document
    assert document["input"][0]["dims"] == [-1, 4]
    # AND one request of 5 rows is centred over its own rows only
    x = np.random.default_rng(4).standard_normal((5, 4)).astype(np.float32)
    answer = served(LocalRepository(tmp_path / "repo"), "centred", tmp_path).infer({"x": x})
    np.testing.assert_allclose(answer["y"], x - x.mean(axis=0), atol=1e-6)


def test_two_int64_inputs_answer_exactly(tmp_path: Path) -> None:
    # GIVEN a two-input int64 model WHEN added
    model = graphs.two_int_inputs(tmp_path / "ints.onnx")
    code, output = add(tmp_path, model, "ints", *ROOMY_P99)
    assert code == 0, output
    # THEN both inputs and outputs are INT64 [3] per row, batched
    document = config_json(tmp_path, "ints")
    assert [(t["name"], t["data_type"], t["dims"]) for t in document["input"]] == [
        ("a", "TYPE_INT64", [3]),
        ("b", "TYPE_INT64", [3]),
    ]
    assert [t["name"] for t in document["output"]] == ["sum", "product"]
    assert document["max_batch_size"] > 1
    # AND a batch answers exactly what numpy computes
    rng = np.random.default_rng(5)
    a, b = (rng.integers(-100, 100, (6, 3)) for _ in range(2))
    answer = served(LocalRepository(tmp_path / "repo"), "ints", tmp_path).infer({"a": a, "b": b})
    assert answer["sum"].tolist() == (a + b).tolist()
    assert answer["product"].tolist() == (a * b).tolist()


def _tokenizer(path: Path) -> Path:
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, "[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.enable_truncation(max_length=16)
    tokenizer.save(str(path))
    return path


def test_a_text_model_takes_its_tokenizer(tmp_path: Path) -> None:
    # GIVEN a mean-pooling encoder and its tokenizer WHEN added with --tokenizer
    model = graphs.mean_pooled_encoder(tmp_path / "encoder.onnx", len(WORDS))
    tokenizer = _tokenizer(tmp_path / "tok.json")
    code, output = add(tmp_path, model, "encoder", "--tokenizer", str(tokenizer), *ROOMY_P99)
    assert code == 0, output
    # THEN the text kind, its tokenizer in the version (checksummed), the tokenizer's length
    document = config_json(tmp_path, "encoder")
    assert document["spillway"]["kind"] == "text_embedding"
    assert document["spillway"]["tokenizer_file"] == "tokenizer.json"
    assert document["spillway"]["max_sequence_length"] == 16
    assert document["input"] == [{"name": "text", "data_type": "TYPE_STRING", "dims": [1]}]
    assert "tokenizer.json" in (tmp_path / "repo" / "encoder" / "1" / "SHA256SUMS").read_text()
    # AND texts of different lengths answer as the graph does on their own token ids
    texts = ["spillway serves your own model", "fast"]
    answer = served(LocalRepository(tmp_path / "repo"), "encoder", tmp_path).infer(
        {"text": np.array([[t.encode()] for t in texts], np.object_)}
    )
    for row, text in enumerate(texts):
        ids = np.array([Tokenizer.from_file(str(tokenizer)).encode(text).ids], np.int64)
        (expected,) = direct(model, {"input_ids": ids, "attention_mask": np.ones_like(ids)})
        np.testing.assert_allclose(answer["embedding"][row], expected[0], atol=1e-5)


def test_a_tokenizer_with_a_graph_that_is_not_a_text_encoder_is_refused(tmp_path: Path) -> None:
    # GIVEN a dense layer and a tokenizer WHEN added as a text model
    model = graphs.dense(tmp_path / "dense.onnx")
    code, output = add(tmp_path, model, "dense", "--tokenizer", str(_tokenizer(tmp_path / "t")))
    # THEN refused in one line, nothing written
    assert code == 1
    assert output.count("\n") == 1
    assert "takes exactly input_ids and attention_mask; this one takes x" in output
    assert not (tmp_path / "repo" / "dense").exists()


def test_an_s3_repository_gets_the_version(tmp_path: Path, aws_env: str) -> None:
    # GIVEN a bucket on the moto server
    from spillway.aws.clients import aws_client

    aws_client("s3").create_bucket(Bucket="own-models")
    model = graphs.dense(tmp_path / "dense.onnx")
    # WHEN a model is added to s3://own-models/repo
    argv = ["models", "add", str(model), "--name", "dense", "--repository", "s3://own-models/repo"]
    argv += ROOMY_P99
    result = CliRunner().invoke(app, argv, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    # THEN the S3 repository serves it, checksums verified on download
    repository = open_repository("s3://own-models/repo")
    assert repository.read_config("dense").max_batch_size == 32
    x = np.ones((2, 4), np.float32)
    answer = served(repository, "dense", tmp_path / "cache").infer({"x": x})
    np.testing.assert_allclose(answer["y"], x @ graphs.WEIGHTS, rtol=1e-6)


def test_load_asks_the_running_gpu_service(tmp_path: Path) -> None:
    # GIVEN a GPU service with explicit model control over an empty repository
    (tmp_path / "repo").mkdir()
    with gpu_service(
        tmp_path / "repo", tmp_path / "logs", "/v2/health/live", model_control_mode="explicit"
    ) as service:
        model = graphs.dense(tmp_path / "dense.onnx")
        # WHEN a model is added with --load
        code, output = add(tmp_path, model, "dense", "--load", "--gpu-url", service.base)
        # THEN the service loaded it and says it is ready
        assert code == 0, output
        assert output.splitlines()[-1] == f"dense: ready on {service.base}"


async def _asgi(app: GpuServiceApp, method: str, path: str, body: bytes = b"") -> tuple[int, Any]:
    """One request through the service's ASGI entry; its status and JSON answer."""
    sent: list[dict[str, Any]] = []
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "headers": [(b"host", b"test"), (b"content-length", str(len(body)).encode())],
        "http_version": "1.1",
    }

    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await asyncio.Event().wait()  # the client stays connected until answered
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    answer = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(answer)


def test_a_folder_with_only_model_onnx_is_served_with_a_completed_config(
    tmp_path: Path,
) -> None:
    # GIVEN a repository whose model folder holds only 1/model.onnx (Triton's layout)
    graphs.dense(tmp_path / "repo" / "plain" / "1" / "model.onnx")
    settings = GpuSettings(
        repository=str(tmp_path / "repo"),
        providers=("CPUExecutionProvider",),
        cache_dir=tmp_path / "cache",
    )
    service = GpuServiceApp(
        DataPlane(ModelRegistry(LocalRepository(tmp_path / "repo"), settings), settings)
    )
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    infer = {
        "inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32", "data": x.ravel().tolist()}]
    }

    async def scenario() -> tuple[tuple[int, Any], tuple[int, Any]]:
        await service.startup()
        try:
            config = await _asgi(service, "GET", "/v2/models/plain/config")
            answer = await _asgi(
                service, "POST", "/v2/models/plain/infer", json.dumps(infer).encode()
            )
            return config, answer
        finally:
            await service.shutdown()

    (config_status, config), (infer_status, answer) = asyncio.run(scenario())
    # WHEN its configuration is asked for THEN it is the one completed from the graph:
    # batchable (dynamic leading dimension), without a dynamic batcher (nothing proven)
    assert config_status == 200
    assert config["max_batch_size"] == 8
    assert config["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}]
    assert config["output"] == [{"name": "y", "data_type": "TYPE_FP32", "dims": [3]}]
    assert "dynamic_batching" not in config
    # AND it answers as the graph does
    assert infer_status == 200, answer
    (output,) = answer["outputs"]
    expected = direct(tmp_path / "repo" / "plain" / "1" / "model.onnx", {"x": x})[0]
    np.testing.assert_allclose(np.array(output["data"]).reshape(2, 3), expected, rtol=1e-6)
