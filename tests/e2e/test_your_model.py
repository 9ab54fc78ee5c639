"""docs/your-model.md, run: a user's own models exported, added with ``spillway models add
--load`` to the running local stack's repository, and called with tritonclient through
the router; every answer equals ONNX Runtime run directly on the same file."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import tritonclient.http as triton
from tokenizers import Tokenizer
from tritonclient.utils import np_to_triton_dtype

from spillway_cli.local.names import REPOSITORY
from spillway_cli.local.stack import LocalStack
from tests.e2e.own_models import fixed_batch_one, not_batch_safe, run_doc_block, two_int64

Arrays = dict[str, np.ndarray]


def add_model(stack: LocalStack, path: Path, name: str, *options: str) -> str:
    """``spillway models add FILE --name NAME --load`` into the stack's repository; its
    output."""
    argv = [sys.executable, "-m", "spillway_cli.main", "models", "add", str(path)]
    argv += ["--name", name, "--repository", REPOSITORY, "--load", "--gpu-url", stack.url("gpu")]
    env = {
        **os.environ,
        **stack.aws_env(),
        "SPILLWAY_STACK_ENV": str(stack.log_dir / "env.json"),  # this stack's, not ./out's
    }
    done = subprocess.run([*argv, *options], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    return done.stdout


def call(port: int, model: str, inputs: Arrays) -> Arrays:
    """One tritonclient (HTTP, binary tensors) request; every output of the model."""
    client = triton.InferenceServerClient(f"127.0.0.1:{port}")
    tensors = []
    for name, array in inputs.items():
        tensor = triton.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    outputs = [o["name"] for o in client.get_model_metadata(model)["outputs"]]
    result = client.infer(model, tensors, outputs=[triton.InferRequestedOutput(n) for n in outputs])
    return {name: result.as_numpy(name) for name in outputs}


def direct(path: Path, inputs: Arrays) -> Arrays:
    """ONNX Runtime on the exported file itself."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, inputs), strict=True))


def served_config(stack: LocalStack, model: str) -> dict[str, Any]:
    config: dict[str, Any] = triton.InferenceServerClient(
        f"127.0.0.1:{stack.ports.gpu}"
    ).get_model_config(model)
    return config


def assert_same(got: Arrays, want: Arrays, atol: float = 1e-5) -> None:
    assert sorted(got) == sorted(want)
    for name, expected in want.items():
        assert got[name].shape == expected.shape, name
        np.testing.assert_allclose(got[name], expected, atol=atol, err_msg=name)


def test_pytorch_cnn_with_a_dynamic_batch(stack: LocalStack, tmp_path: Path) -> None:
    run_doc_block("export_cnn.py", tmp_path)
    add_model(stack, tmp_path / "cnn.onnx", "my-cnn")
    images = np.random.default_rng(0).standard_normal((5, 1, 8, 8)).astype(np.float32)
    assert served_config(stack, "my-cnn")["max_batch_size"] > 1
    got = call(stack.ports.router, "my-cnn", {"image": images})
    assert_same(got, direct(tmp_path / "cnn.onnx", {"image": images}))


def test_scikit_learn_pipeline(stack: LocalStack, tmp_path: Path) -> None:
    run_doc_block("export_sklearn.py", tmp_path)
    add_model(stack, tmp_path / "iris.onnx", "iris")
    rows = np.array([[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3], [5.9, 3.0, 4.2, 1.5]])
    features = rows.astype(np.float32)
    got = call(stack.ports.router, "iris", {"X": features})
    want = direct(tmp_path / "iris.onnx", {"X": features})
    assert_same(got, want)
    assert want["label"].tolist() == [0, 2, 1]


def test_a_fixed_batch_of_one(stack: LocalStack, tmp_path: Path) -> None:
    path = fixed_batch_one(tmp_path / "fixed.onnx")
    add_model(stack, path, "fixed-one")
    assert served_config(stack, "fixed-one")["max_batch_size"] == 0
    x = np.random.default_rng(1).standard_normal((1, 8)).astype(np.float32)
    assert_same(call(stack.ports.router, "fixed-one", {"x": x}), direct(path, {"x": x}))


def test_two_int64_inputs(stack: LocalStack, tmp_path: Path) -> None:
    path = two_int64(tmp_path / "two.onnx")
    add_model(stack, path, "two-int64")
    rng = np.random.default_rng(2)
    inputs = {name: rng.integers(-(2**40), 2**40, (4, 3), dtype=np.int64) for name in "ab"}
    got = call(stack.ports.router, "two-int64", inputs)
    want = direct(path, inputs)
    assert got["y"].dtype == np.int64
    np.testing.assert_array_equal(got["y"], want["y"])


def test_a_model_that_is_not_batch_safe_is_never_batched(stack: LocalStack, tmp_path: Path) -> None:
    path = not_batch_safe(tmp_path / "mixing.onnx")
    add_model(stack, path, "mixing")
    # max_batch_size 0: a request's leading dimension is the model's own
    assert served_config(stack, "mixing")["max_batch_size"] == 0
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 4)).astype(np.float32)
    assert_same(call(stack.ports.router, "mixing", {"x": x}), direct(path, {"x": x}))
    # Many requests at once straight at the GPU service: each answer is its own rows'
    # (a batch would subtract the mean of every request's rows), one execution each.
    gpu = triton.InferenceServerClient(f"127.0.0.1:{stack.ports.gpu}")
    before = gpu.get_inference_statistics("mixing")["model_stats"][0]
    requests = [rng.standard_normal((3, 4)).astype(np.float32) for _ in range(16)]

    def answered(rows: np.ndarray) -> None:
        assert_same(call(stack.ports.gpu, "mixing", {"x": rows}), direct(path, {"x": rows}))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(answered, requests))
    after = gpu.get_inference_statistics("mixing")["model_stats"][0]
    executions = after["execution_count"] - before["execution_count"]
    inferences = after["inference_count"] - before["inference_count"]
    assert executions == inferences == len(requests)
    assert [b["batch_size"] for b in after["batch_stats"]] == [1]


def test_hugging_face_text_encoder_with_its_tokenizer(stack: LocalStack, tmp_path: Path) -> None:
    run_doc_block("export_encoder.py", tmp_path)
    tokenizer_file = tmp_path / "tokenizer.json"
    # A p99 target this machine's profile meets with batches (a loaded 2-core runner takes
    # ~100 ms for one sentence): the call below sends three rows at once.
    with_tokenizer = ("--tokenizer", str(tokenizer_file))
    add_model(stack, tmp_path / "encoder.onnx", "my-encoder", *with_tokenizer, "--p99-ms", "5000")
    texts = ["serve your own model", "a Hugging Face text encoder, exported", "ok"]
    metadata = triton.InferenceServerClient(f"127.0.0.1:{stack.ports.router}").get_model_metadata(
        "my-encoder"
    )
    (text_input,) = metadata["inputs"]
    assert text_input["datatype"] == "BYTES"
    batch = np.array([[t.encode()] for t in texts], dtype=np.object_)
    got = call(stack.ports.router, "my-encoder", {text_input["name"]: batch})
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    tokenizer.enable_padding(pad_id=0)
    encodings = tokenizer.encode_batch(texts)
    feeds = {
        "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
        "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
    }
    assert_same(got, direct(tmp_path / "encoder.onnx", feeds))
