"""Publishing a model version is all or nothing, on a folder and on S3 (moto)."""

from __future__ import annotations

from pathlib import Path

import boto3
import pytest

from spillway.models.config import ModelConfig
from spillway.models.repository import LocalRepository, S3Repository

CONFIG = ModelConfig.model_validate(
    {
        "name": "m",
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [1]}],
        "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [1]}],
    }
)


def _files(tmp_path: Path) -> dict[str, Path]:
    good = tmp_path / "model.onnx"
    good.write_bytes(b"onnx bytes")
    return {"model.onnx": good, "extra.bin": tmp_path / "missing.bin"}  # the second fails


def test_a_failed_local_publish_leaves_nothing_and_keeps_the_number(tmp_path: Path) -> None:
    # GIVEN a folder repository and a publish whose second file cannot be read
    root = tmp_path / "repo"
    root.mkdir()
    repo = LocalRepository(root)
    files = _files(tmp_path)
    # WHEN it is published
    with pytest.raises(FileNotFoundError):
        repo.publish_version("m", files, CONFIG)
    # THEN no version folder (not even a hidden one) is left, and the next good publish is 1
    assert sorted(p.name for p in (root / "m").iterdir()) == ["config.json"]
    assert repo.publish_version("m", {"model.onnx": files["model.onnx"]}) == 1
    assert repo.list_versions("m") == [1]


def test_a_failed_s3_publish_removes_its_objects_and_keeps_the_number(
    aws_env: str, tmp_path: Path
) -> None:
    # GIVEN an S3 repository on moto and a publish whose second file cannot be read
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="publish-test")
    repo = S3Repository("publish-test", "repo", s3)
    files = _files(tmp_path)
    # WHEN it is published
    with pytest.raises(FileNotFoundError):
        repo.publish_version("m", files, CONFIG)
    # THEN only the configuration remains, and the next good publish is version 1
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="publish-test").get("Contents", [])]
    assert keys == ["repo/m/config.json"]
    assert repo.publish_version("m", {"model.onnx": files["model.onnx"]}) == 1
    assert repo.list_versions("m") == [1]
