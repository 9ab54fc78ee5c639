"""What ``spillway models add | rollback`` changes after the CPU fallback started is what
it serves on the next request, as the GPU service does once asked to load it:

* a model's signature replaced (a new default version that takes other inputs), or
  rolled back, serves a request that fits the new default at once — the index is read
  again when a request does not fit the default it knew, at most once per miss window;
* a pipeline published after start is checked and served by its first request.

Real ONNX Runtime on the demo's models in a local repository; the index's clock is the
test's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spillway.fallback.direct import handle_direct
from spillway.fallback.service import CpuService
from spillway.fallback.settings import CpuSettings
from spillway.models.config import ModelConfig, TensorConfig, VersionPolicy
from spillway.models.engine import EngineOptions
from spillway.models.loader import OnDemandVersions
from spillway.models.repository import LocalRepository
from spillway.pipelines.serving import PipelineSet
from tests import graphs
from tests.integration.test_cpu_on_demand import IMAGE, Clock
from tests.support import link_model

X = {"name": "x", "shape": [2, 4], "datatype": "FP32", "data": [1, 2, 3, 4, 0, 0.5, -1, 8]}


def _service(repo: LocalRepository, tmp_path: Path, clock: Clock) -> CpuService:
    """A CPU fallback over every model of ``repo`` (as deployed: no ``CPU_MODELS``)."""
    settings = CpuSettings(repository=repo.location, cache_dir=tmp_path / "cache")
    versions = OnDemandVersions(
        repo,
        None,
        cache_dir=settings.cache_dir,
        options=EngineOptions(),
        miss_refresh_s=1.0,
        clock=clock,
    )
    return CpuService(versions, settings, PipelineSet.read(repo, None, None))


def _infer(service: CpuService, model: str, inputs: dict[str, Any]) -> tuple[int, Any, str]:
    answer = handle_direct(service, {"model": model, "body": {"inputs": [inputs]}})
    body = json.loads(answer["body"])
    return answer["statusCode"], body, answer["headers"].get("x-spillway-model-version", "")


def _serving_digits(models_dir: Path, tmp_path: Path) -> tuple[LocalRepository, Clock, CpuService]:
    """A repository holding the demo's digits, and a CPU fallback over it."""
    root = tmp_path / "repo"
    root.mkdir()
    link_model(models_dir, root, "digits")
    repo = LocalRepository(root)
    clock = Clock()
    return repo, clock, _service(repo, tmp_path, clock)


def _dense_config() -> ModelConfig:
    """digits' name over ``tests.graphs.dense``: x FP32 [4] -> y FP32 [3]."""
    return ModelConfig(
        name="digits",
        max_batch_size=8,
        input=(TensorConfig(name="x", data_type="TYPE_FP32", dims=(4,)),),
        output=(TensorConfig(name="y", data_type="TYPE_FP32", dims=(3,)),),
    )


def test_a_replaced_signature_and_a_rollback_are_served_at_once(
    models_dir: Path, tmp_path: Path
) -> None:
    # GIVEN a CPU fallback that has served digits v1 (an image classifier)
    repo, clock, service = _serving_digits(models_dir, tmp_path)
    assert _infer(service, "digits", IMAGE)[::2] == (200, "1")
    v1 = repo.read_config("digits")
    # WHEN v2 replaces its signature (x FP32 [4]) and, a little later, a request fits it
    dense = graphs.dense(tmp_path / "dense.onnx")
    assert repo.publish_version("digits", {"model.onnx": dense}, _dense_config()) == 2
    clock.now += 5
    status, body, version = _infer(service, "digits", X)
    # THEN v2 answers it: y = x @ W
    assert (status, version) == (200, "2"), body
    expected = np.array(X["data"], np.float32).reshape(2, 4) @ graphs.WEIGHTS
    np.testing.assert_allclose(np.array(body["outputs"][0]["data"]).reshape(2, 3), expected)
    # AND an image sent right after is refused without another read (the last one is
    # less than the miss window old): v2 does not take images
    status, body, _ = _infer(service, "digits", IMAGE)
    assert (status, body["code"]) == (400, "invalid_input")
    # WHEN digits is rolled back to v1 (its configuration, policy [1]) and an image comes
    rolled = v1.model_copy(update={"version_policy": VersionPolicy(specific={"versions": (1,)})})
    repo.write_config("digits", rolled)
    clock.now += 5
    # THEN v1 answers it, and an x request is now the client's mistake
    assert _infer(service, "digits", IMAGE)[::2] == (200, "1")
    clock.now += 5
    status, body, _ = _infer(service, "digits", X)
    assert (status, body["code"]) == (400, "invalid_input")
    assert "unknown input 'x'" in body["error"]


def test_a_request_that_fits_nothing_reads_the_index_once_per_window(
    models_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN a CPU fallback serving digits, its index reads counted
    repo, clock, service = _serving_digits(models_dir, tmp_path)
    assert _infer(service, "digits", IMAGE)[0] == 200
    reads: list[float] = []
    read_config = repo.read_config

    def counted(name: str) -> ModelConfig:
        reads.append(clock.now)
        return read_config(name)

    monkeypatch.setattr(repo, "read_config", counted)
    # WHEN 20 requests that fit no version come, 10 at one moment two seconds after the
    # index was read and 10 two seconds later
    answers = []
    for _ in range(2):
        clock.now += 2
        answers += [_infer(service, "digits", X)[:2] for _ in range(10)]
    # THEN each is a 400, after one read of the index in each window
    assert {(status, body["code"]) for status, body in answers} == {(400, "invalid_input")}
    assert reads == [102.0, 104.0]


def test_a_pipeline_published_after_start_is_served_by_its_first_request(
    models_dir: Path, tmp_path: Path
) -> None:
    # GIVEN a CPU fallback started over minilm and topics' head, without the pipeline
    root = tmp_path / "repo"
    root.mkdir()
    for name in ("minilm", "topics-head"):
        link_model(models_dir, root, name)
    repo = LocalRepository(root)
    clock = Clock()
    service = _service(repo, tmp_path, clock)
    text = {"name": "text", "shape": [2, 1], "datatype": "BYTES"}
    text["data"] = ["the striker scored twice", "my cat sleeps all day"]
    assert _infer(service, "topics", text)[1]["code"] == "model_not_found"
    # WHEN the topics pipeline is published, and a request names it
    link_model(models_dir, root, "topics")
    clock.now += 5
    status, body, _ = _infer(service, "topics", text)
    # THEN it answers as a fallback that knew the pipeline at start does
    assert status == 200, body
    knew = _service(repo, tmp_path / "knew", Clock())
    assert body == _infer(knew, "topics", text)[1]
