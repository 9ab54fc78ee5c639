"""A CPU fallback initialised on demand loads what a request needs when it needs it: its
cold start's first answer waits for one model's load, not every model's; provisioned
concurrency and SnapStart (and any process outside Lambda) load everything at init.
Real ONNX Runtime on the demo's models in a local repository."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.cold_start import cold_start
from spillway.fallback.direct import handle_direct
from spillway.fallback.service import CpuService
from spillway.fallback.settings import CpuSettings
from spillway.models.repository import LocalRepository
from tests.integration.test_cpu_on_demand import IMAGE
from tests.support import link_model


@pytest.mark.parametrize(
    ("environ", "preload", "loads"),
    [
        ({}, None, True),
        ({"AWS_LAMBDA_INITIALIZATION_TYPE": "on-demand"}, None, False),
        ({"AWS_LAMBDA_INITIALIZATION_TYPE": "provisioned-concurrency"}, None, True),
        ({"AWS_LAMBDA_INITIALIZATION_TYPE": "snap-start"}, None, True),
        ({"AWS_LAMBDA_INITIALIZATION_TYPE": "on-demand"}, True, True),
        ({}, False, False),
    ],
    ids=["outside-lambda", "on-demand", "provisioned", "snap-start", "forced-on", "forced-off"],
)
def test_which_initialisations_load_every_model(
    environ: dict[str, str], preload: bool | None, loads: bool
) -> None:
    # GIVEN CPU_PRELOAD as set (or not) WHEN Lambda initialises the function this way
    settings = CpuSettings(preload=preload)
    # THEN init loads every served version only where no request is waiting for it
    assert settings.preloads(environ) is loads


def test_an_on_demand_cold_start_loads_only_the_model_its_request_needs(
    models_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN a repository with digits, minilm and topics' head, and a Lambda instance
    # initialised on demand
    root = tmp_path / "repo"
    root.mkdir()
    for name in ("digits", "minilm", "topics-head"):
        link_model(models_dir, root, name)
    monkeypatch.setenv("AWS_LAMBDA_INITIALIZATION_TYPE", "on-demand")
    settings = CpuSettings(repository=str(root), cache_dir=tmp_path / "cache")
    # WHEN the function initialises
    service = CpuService.load(settings, LocalRepository(root))
    # THEN nothing is loaded yet
    assert service.models == {}
    # WHEN its first request asks digits
    answer = handle_direct(service, {"model": "digits", "body": {"inputs": [IMAGE]}})
    # THEN digits answers, and digits alone was loaded
    assert answer["statusCode"] == 200, answer["body"]
    assert {name: sorted(v) for name, v in service.models.items()} == {"digits": [1]}
    # AND the same start outside an on-demand initialisation loads all three at init
    monkeypatch.setenv("AWS_LAMBDA_INITIALIZATION_TYPE", "provisioned-concurrency")
    warm = CpuService.load(settings, LocalRepository(root))
    assert sorted(warm.models) == ["digits", "minilm", "topics-head"]


def test_the_cold_start_bench_measures_an_on_demand_start(models_dir: Path) -> None:
    # GIVEN the demo's repository WHEN bench/cold_start.py starts the function once, on demand
    result = cold_start(models_dir, "on-demand")
    # THEN its first invocation was answered, and digits alone was loaded by then
    assert (result["status"], result["again"], result["loaded"]) == (200, 200, ["digits"])
    assert float(result["init"]) > 0
    assert float(result["first"]) > 0
