"""Test support: model repositories and real server processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from spillway.aws.clients import aws_client
from spillway.models.engine import EngineOptions, OnnxModel
from spillway.models.repository import LocalRepository
from spillway_cli.local import procs
from spillway_cli.modelbuild.common import write_checksums


def slow_model(size: int = 2048, steps: int = 5) -> onnx.ModelProto:
    """``y = x`` after ``steps`` dense ``size``×``size`` matmuls that depend on ``x``: a
    real model that keeps the CPU busy for a while, so tests can hold a batch running."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 1])
    fill = helper.make_tensor("fill", TensorProto.FLOAT, [1], [1.0 / size])
    nodes = [
        helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
        helper.make_node("ConstantOfShape", ["shape"], ["ones"], value=fill),
        helper.make_node("Mul", ["ones", "s"], ["a0"]),
    ]
    for i in range(steps):
        nodes += [
            helper.make_node("MatMul", [f"a{i}", f"a{i}"], [f"m{i}"]),
            helper.make_node("Tanh", [f"m{i}"], [f"a{i + 1}"]),
        ]
    nodes += [
        helper.make_node("ReduceSum", [f"a{steps}"], ["t"], keepdims=0),
        helper.make_node("Mul", ["t", "zero"], ["z"]),
        helper.make_node("Add", ["x", "z"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(np.array([size, size], np.int64), "shape"),
        numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
    ]
    graph = helper.make_graph(nodes, "slow", [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def write_slow_model(
    root: Path,
    name: str = "slow",
    *,
    max_batch_size: int = 4,
    max_queue_size: int = 4,
    delay_us: int = 0,
    steps: int = 5,
) -> None:
    """A ``slow`` model with its config and checksums in a repository folder."""
    version_dir = root / name / "1"
    version_dir.mkdir(parents=True, exist_ok=True)
    onnx.save(slow_model(steps=steps), version_dir / "model.onnx")
    write_checksums(version_dir)
    config = {
        "name": name,
        "platform": "onnxruntime_onnx",
        "max_batch_size": max_batch_size,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [1]}],
        "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [1]}],
        "dynamic_batching": {
            "max_queue_delay_microseconds": delay_us,
            "priority_levels": 2,
            "default_priority_level": 2,
            "default_queue_policy": {"max_queue_size": max_queue_size},
        },
    }
    (root / name / "config.json").write_text(json.dumps(config))


def link_model(source: Path, root: Path, name: str) -> None:
    """A model from another repository, hard-linked (no copy of the weights)."""
    shutil.copytree(source / name, root / name, copy_function=os.link)


class Service:
    """A GPU service process on 127.0.0.1 and its URL."""

    def __init__(self, child: procs.Child, port: int) -> None:
        self.child = child
        self.port = port
        self.url = f"127.0.0.1:{port}"
        self.base = f"http://127.0.0.1:{port}"


@contextmanager
def gpu_service(
    repository: Path | str,
    log_dir: Path,
    wait_path: str = "/v2/health/ready",
    *,
    port: int | None = None,
    **settings: str,
) -> Iterator[Service]:
    """``python -m gpu_service`` with ``GPU_*`` settings (on ``port``, else a free one);
    stopped by PID afterwards."""
    port = port or procs.free_port()
    env = {
        "GPU_REPOSITORY": str(repository),
        "GPU_PORT": str(port),
        "GPU_PROVIDERS": '["CPUExecutionProvider"]',
        **{f"GPU_{k.upper()}": v for k, v in settings.items()},
    }
    child = procs.start(f"gpu-{port}", [sys.executable, "-m", "gpu_service"], log_dir, env)
    try:
        procs.wait_http(f"http://127.0.0.1:{port}{wait_path}", 120, child.proc)
    except (RuntimeError, TimeoutError) as exc:
        child.stop()
        raise RuntimeError(f"{exc}\n{child.log_tail()}") from exc
    try:
        yield Service(child, port)
    finally:
        child.stop()


@contextmanager
def scope_proof_secret(moto_endpoint: str) -> Iterator[tuple[Any, str]]:
    """A scope proof key made on the moto server as ``spillway up`` makes it (a generated
    Secrets Manager secret), named by ``SCOPE_PROOF_SECRET_ID`` and boto3's variables for
    everything started within (a GPU service's process too): the Secrets Manager client
    and the secret's name."""
    import pytest

    from spillway_cli.local.scope_key import create_scope_key

    name = f"spillway-test-scope-proof-{uuid.uuid4().hex[:8]}"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ENDPOINT_URL", moto_endpoint)
        for variable in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            env.setenv(variable, "testing")
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        env.setenv("SCOPE_PROOF_SECRET_ID", name)
        client = aws_client("secretsmanager")
        create_scope_key(client, name)
        yield client, name


@contextmanager
def scope_proof_key(moto_endpoint: str) -> Iterator[Callable[[str], str]]:
    """``scope_proof_secret``, yielding the router's signer, so a test can send a backend
    a scope the router vouches for."""
    from spillway.tenancy.proof import KeyRing, ScopeProofs, StaticKeys

    with scope_proof_secret(moto_endpoint) as (client, name):
        key = client.get_secret_value(SecretId=name)["SecretString"].encode()
        yield ScopeProofs(StaticKeys(KeyRing(key))).sign


def load_engine(models: Path, name: str, options: EngineOptions | None = None) -> OnnxModel:
    """A model's newest version from a repository folder, loaded directly in the engine
    (the reference the served results are compared with)."""
    repo = LocalRepository(models)
    version = repo.list_versions(name)[-1]
    path = repo.fetch_version(name, version, models)
    return OnnxModel(name, version, repo.read_config(name), path, options or EngineOptions())
