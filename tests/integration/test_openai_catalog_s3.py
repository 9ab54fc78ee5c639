"""The OpenAI-compatible door's catalogue as the deployed router reads it: the repository
on S3 (the moto server), its location in an SSM parameter, both read with the router's
own clients. No graph and no tokenizer is read, only configurations and checksums."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from spillway.aws.clients import aws_client
from spillway.models.config import ModelConfig
from spillway.models.repository import open_repository
from spillway.protocol.errors import ModelNotFoundError, UnavailableError
from spillway.router.openai_compat.catalog import EmbeddingCatalog
from spillway.router.settings import RouterSettings
from spillway.router.wiring import embedding_catalog
from tests.unit.openai_support import classifier_config, embedder_config


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Located:
    """A catalogue, its clock, and the SSM parameter it reads the location from."""

    catalog: EmbeddingCatalog
    clock: Clock
    parameter: str


def _publish(location: str, config: dict[str, object], tmp_path: Path) -> None:
    files = {}
    for name in ("model.onnx", "tokenizer.json"):
        path = tmp_path / f"{config['name']}-{name}"
        path.write_bytes(b"contents the router never reads")
        files[name] = path
    model = ModelConfig.model_validate(config)
    open_repository(location).publish_version(str(config["name"]), files, model)


@pytest.fixture
def located(aws_env: str, tmp_path: Path) -> Callable[[str], Located]:
    """A bucket with two repositories, and a catalogue over the one an SSM parameter
    names (its name given)."""
    bucket = f"models-{uuid.uuid4().hex[:8]}"
    aws_client("s3").create_bucket(Bucket=bucket)
    _publish(f"s3://{bucket}/models", embedder_config(), tmp_path)
    _publish(f"s3://{bucket}/models", classifier_config(), tmp_path)
    _publish(f"s3://{bucket}/next", embedder_config("e5"), tmp_path)

    def catalog(where: str) -> Located:
        parameter = f"/spillway-{uuid.uuid4().hex[:8]}/router/model-repository"
        aws_client("ssm").put_parameter(
            Name=parameter, Value=f"s3://{bucket}/{where}", Type="String"
        )
        clock = Clock()
        settings = RouterSettings(model_repository_parameter=parameter, catalog_ttl_s=60)
        made = embedding_catalog(settings, clock)
        assert made is not None
        return Located(made, clock, parameter)

    return catalog


def test_the_catalogue_reads_the_repository_the_parameter_names(
    located: Callable[[str], Located],
) -> None:
    # GIVEN the parameter naming s3://<bucket>/models
    catalog = located("models").catalog
    # WHEN the door lists the models and asks for them
    (minilm,) = catalog.models()
    # THEN it offers the text embedding model alone, its signature read from S3
    assert (minilm.name, minilm.text_input, minilm.output, minilm.dimensions) == (
        "minilm",
        "text",
        "embedding",
        4,
    )
    assert minilm.created > 1_600_000_000
    with pytest.raises(ModelNotFoundError, match="its kind is image_classifier"):
        catalog.model("digits")


def test_a_moved_repository_is_followed_after_the_ttl(
    located: Callable[[str], Located],
) -> None:
    # GIVEN a catalogue over s3://<bucket>/models, then the parameter moved to .../next
    door = located("models")
    assert [m.name for m in door.catalog.models()] == ["minilm"]
    ssm = aws_client("ssm")
    value = ssm.get_parameter(Name=door.parameter)["Parameter"]["Value"]
    moved = value.removesuffix("/models") + "/next"
    ssm.put_parameter(Name=door.parameter, Value=moved, Type="String", Overwrite=True)
    # WHEN the TTL passes
    door.clock.now += 61
    # THEN the door offers the models of the new location
    assert [m.name for m in door.catalog.models()] == ["e5"]


def test_a_missing_parameter_is_a_503_not_an_empty_list(aws_env: str) -> None:
    settings = RouterSettings(model_repository_parameter=f"/nobody/{uuid.uuid4().hex}")
    catalog = embedding_catalog(settings, Clock())
    assert catalog is not None
    with pytest.raises(UnavailableError, match="location cannot be read"):
        catalog.models()
