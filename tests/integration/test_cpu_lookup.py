"""The CPU fallback looks a name up once and asks one interface, whatever serves it."""

from __future__ import annotations

from pathlib import Path

import pytest

from spillway.fallback.service import CpuModel, CpuPipeline, CpuService
from spillway.fallback.settings import CpuSettings
from spillway.protocol.errors import InvalidInputError, ModelNotFoundError

NOT_A_REQUEST = b"{not json"


@pytest.fixture(scope="module")
def cpu(models_dir: Path) -> CpuService:
    return CpuService.load(CpuSettings(repository=str(models_dir), models=["digits", "topics"]))


def test_a_model_and_an_pipeline_are_found_as_their_kinds(cpu: CpuService) -> None:
    # GIVEN a fallback serving a model and a pipeline
    # WHEN each name is looked up
    model, pipeline = cpu.find("digits"), cpu.find("topics")
    # THEN each is its kind, and answers for its own name and versions
    assert isinstance(model, CpuModel)
    assert isinstance(pipeline, CpuPipeline)
    assert model.metadata(None)["name"] == "digits"
    assert pipeline.metadata(None)["name"] == "topics"
    assert pipeline.config(None)["platform"] == "ensemble"
    assert pipeline.metadata(None)["versions"] == ["1"]


@pytest.mark.parametrize("name", ["digits", "topics"])
def test_a_version_not_served_is_refused_before_the_body_is_decoded(
    cpu: CpuService, name: str
) -> None:
    # GIVEN a body that does not decode
    # WHEN it names a version neither kind serves
    with pytest.raises(ModelNotFoundError) as refused:
        cpu.infer(name, "9", NOT_A_REQUEST, None)
    # THEN the version is refused (404), not the body
    assert "9" in refused.value.message
    # AND the served version gets as far as decoding it (400)
    with pytest.raises(InvalidInputError):
        cpu.infer(name, None, NOT_A_REQUEST, None)
