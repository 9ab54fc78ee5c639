"""Model repository: local folder and S3 through a real moto server on 127.0.0.1."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from spillway.aws.clients import aws_client
from spillway.models.repository import LocalRepository, S3Repository, open_repository
from spillway.protocol.errors import (
    ChecksumMismatchError,
    InvalidModelNameError,
    ModelLoadError,
    ModelNotFoundError,
)
from spillway.protocol.names import validate_model_name, validate_version

BAD_NAMES = [
    "..",
    ".",
    "%2e%2e",
    "a/b",
    "/etc/passwd",
    "../digits",
    "digits/../x",
    "",
    "Digits",
    "-x",
    "x" * 65,
    "a\\b",
    "a b",
    "a\x00b",
]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_unsafe_model_names_are_rejected(name: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidModelNameError) as caught:
        validate_model_name(name)
    assert caught.value.status == 400
    # AND a repository never forms a path from it
    with pytest.raises(InvalidModelNameError):
        LocalRepository(tmp_path).read_config(name)


@pytest.mark.parametrize("version", ["0", "-1", "1.0", "1e3", "", "１", "9999999999", "a"])
def test_bad_versions_are_rejected(version: str) -> None:
    with pytest.raises(InvalidModelNameError):
        validate_version(version)


def test_good_names_and_versions_pass() -> None:
    assert validate_model_name("mlp-bench") == "mlp-bench"
    assert validate_model_name("a.b_c-1") == "a.b_c-1"
    assert validate_version("12") == 12


def test_local_repository_lists_and_verifies(models_dir: Path) -> None:
    repo = open_repository(str(models_dir))
    assert {"digits", "minilm", "mlp-bench"} <= set(repo.list_models())
    assert repo.list_versions("digits") == [1]
    assert repo.read_config("minilm").spillway.kind == "text_embedding"
    path = repo.fetch_version("digits", 1, models_dir)
    assert (path / "model.onnx").is_file()


def test_unknown_model_and_version(models_dir: Path) -> None:
    repo = LocalRepository(models_dir)
    with pytest.raises(ModelNotFoundError):
        repo.read_config("no-such-model")
    with pytest.raises(ModelNotFoundError):
        repo.fetch_version("digits", 99, models_dir)


@pytest.fixture
def digits_copy(models_dir: Path, tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(models_dir / "digits", root / "digits")
    return root


def test_local_checksum_mismatch_is_detected(digits_copy: Path) -> None:
    # GIVEN a model file changed after its checksum was recorded
    onnx_path = digits_copy / "digits" / "1" / "model.onnx"
    data = bytearray(onnx_path.read_bytes())
    data[-1] ^= 0xFF
    onnx_path.write_bytes(bytes(data))
    # WHEN the version is fetched THEN the mismatch is refused
    with pytest.raises(ChecksumMismatchError) as caught:
        LocalRepository(digits_copy).fetch_version("digits", 1, digits_copy)
    assert caught.value.code == "checksum_mismatch"


def test_missing_files_are_clear_errors(digits_copy: Path) -> None:
    version_dir = digits_copy / "digits" / "1"
    (version_dir / "model.onnx").unlink()
    with pytest.raises(ModelLoadError, match=r"model\.onnx is missing"):
        LocalRepository(digits_copy).fetch_version("digits", 1, digits_copy)
    (version_dir / "SHA256SUMS").unlink()
    with pytest.raises(ModelLoadError, match="SHA256SUMS is missing"):
        LocalRepository(digits_copy).fetch_version("digits", 1, digits_copy)


def test_traversal_in_checksum_file_is_refused(digits_copy: Path) -> None:
    sums = digits_copy / "digits" / "1" / "SHA256SUMS"
    sums.write_text(sums.read_text() + f"{'0' * 64}  ../../etc/passwd\n")
    with pytest.raises(ModelLoadError, match="malformed"):
        LocalRepository(digits_copy).fetch_version("digits", 1, digits_copy)


def _upload(client: Any, bucket: str, prefix: str, root: Path, model: str) -> None:
    for path in sorted((root / model).rglob("*")):
        if path.is_file():
            key = f"{prefix}/{path.relative_to(root).as_posix()}"
            client.upload_file(str(path), bucket, key)


@pytest.fixture
def s3_repo(aws_env: str, models_dir: Path) -> tuple[S3Repository, Any]:
    # The client finds the moto server through AWS_ENDPOINT_URL alone.
    client = aws_client("s3", "us-east-1")
    assert client.meta.endpoint_url == aws_env
    bucket = "spillway-models-test"
    client.create_bucket(Bucket=bucket)
    for model in ("digits", "minilm"):
        _upload(client, bucket, "repo", models_dir, model)
    repo = open_repository(f"s3://{bucket}/repo")
    assert isinstance(repo, S3Repository)
    return repo, client


def test_s3_repository_fetches_verified_versions(
    s3_repo: tuple[S3Repository, Any], models_dir: Path, tmp_path: Path
) -> None:
    repo, _ = s3_repo
    assert repo.list_models() == ["digits", "minilm"]
    assert repo.list_versions("minilm") == [1]
    path = repo.fetch_version("minilm", 1, tmp_path / "cache")
    assert (path / "model.onnx").read_bytes() == (models_dir / "minilm/1/model.onnx").read_bytes()
    assert (path / "tokenizer.json").is_file()


def test_s3_checksum_mismatch_is_refused(s3_repo: tuple[S3Repository, Any], tmp_path: Path) -> None:
    repo, client = s3_repo
    client.put_object(
        Bucket=repo.bucket,
        Key="repo/digits/1/model.onnx",
        Body=b"tampered",
    )
    with pytest.raises(ChecksumMismatchError):
        repo.fetch_version("digits", 1, tmp_path / "cache")
    # AND nothing half-downloaded is left for a later load to pick up
    assert not (tmp_path / "cache" / "digits" / "1").exists()


def test_s3_unknown_model(s3_repo: tuple[S3Repository, Any], tmp_path: Path) -> None:
    repo, _ = s3_repo
    with pytest.raises(ModelNotFoundError):
        repo.read_config("nope")
    with pytest.raises(ModelNotFoundError):
        repo.fetch_version("digits", 7, tmp_path)
    with pytest.raises(InvalidModelNameError):
        repo.list_versions("../x")


def test_a_file_beside_the_models_is_not_a_model(tmp_path: Path) -> None:
    # GIVEN a local repository with one model folder and loose files whose names are
    # valid model names (a graph kept beside the models, a note)
    version = tmp_path / "plain" / "1"
    version.mkdir(parents=True)
    (version / "model.onnx").write_bytes(b"graph")
    (tmp_path / "resnet50.onnx").write_bytes(b"graph")
    (tmp_path / "notes").write_text("not a model")
    # WHEN the models are listed
    # THEN only the folder is one, and listing does not fail on the files
    assert LocalRepository(tmp_path).list_models() == ["plain"]
