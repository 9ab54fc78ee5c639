"""The model registry a user drives: ``spillway models add | list | show | rollback |
remove | publish`` on real files, a folder repository and an S3 one on the moto server.

The story of issue 35: the demo's ``digits`` (an image classifier, ``image`` FP32 [8, 8])
and another graph (``x`` FP32 [4]) added under the same name. What the repository serves
is asserted on what every server would load: ``loader.chosen_versions`` over the written
``config.json`` and the committed versions.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import boto3
import numpy as np
import onnxruntime as ort
import pytest
from sklearn.datasets import load_digits
from typer.testing import CliRunner, Result

from spillway.models.config import ModelConfig
from spillway.models.engine import EngineOptions
from spillway.models.loader import chosen_versions, load_version
from spillway.models.repository import ManagedRepository, ModelRepository, open_repository
from spillway_cli.main import app
from spillway_cli.models_where import gpu_call
from tests import graphs
from tests.support import gpu_service

ROOMY_P99 = ("--p99-ms", "5000")  # see tests/integration/test_models_add.py


@pytest.fixture(autouse=True)
def no_local_stack(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No running stack's env file reaches these commands (each names its repository)."""
    monkeypatch.setenv("SPILLWAY_STACK_ENV", str(tmp_path / "no-stack" / "env.json"))
    for name in ("SPILLWAY_REPOSITORY", "SPILLWAY_GPU_URL", "SPILLWAY_ADMIN_TOKEN"):
        monkeypatch.delenv(name, raising=False)


def models(*argv: str) -> Result:
    """``spillway models ARGV`` in this process."""
    return CliRunner().invoke(app, ["models", *argv])


def served(repository: ModelRepository, name: str) -> list[int]:
    """The versions every server loads for ``name``: its policy over its versions."""
    config = repository.read_config(name)
    return chosen_versions(config.version_policy, repository.list_versions(name))


def demo_digits(models_dir: Path, location: str) -> ManagedRepository:
    """A repository at ``location`` holding the demo's digits as its v1."""
    if not location.startswith("s3://"):
        Path(location).mkdir(parents=True, exist_ok=True)
    repository = open_repository(location)
    config = ModelConfig.model_validate_json((models_dir / "digits" / "config.json").read_bytes())
    repository.publish_version("digits", {"model.onnx": models_dir / "digits/1/model.onnx"}, config)
    return repository


def listing(location: str) -> dict[str, dict[str, Any]]:
    result = models("list", "--repository", location, "--json")
    assert result.exit_code == 0, result.output
    return {row["name"]: row for row in json.loads(result.stdout)}


def assert_serves_digits(repository: ModelRepository, models_dir: Path, tmp_path: Path) -> None:
    """The served version answers a digits image as the demo's graph does on its pixels."""
    config = repository.read_config("digits")
    (version,) = served(repository, "digits")
    model = load_version(repository, config, version, tmp_path / "cache", EngineOptions())
    images = load_digits().images[:3].astype(np.float32)
    answer = model.infer({"image": images})
    session = ort.InferenceSession(
        str(models_dir / "digits/1/model.onnx"), providers=["CPUExecutionProvider"]
    )
    label, _ = session.run(None, {"input": images.reshape(3, 64)})
    assert answer["label"].tolist() == label.tolist()


@pytest.fixture(params=["folder", "s3"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A folder repository, or an S3 one on the moto server."""
    if request.param == "folder":
        return str(tmp_path / "repo")
    request.getfixturevalue("aws_env")
    bucket = f"registry-{os.getpid()}-{abs(hash(str(tmp_path))) % 10**8}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    return f"s3://{bucket}/models"


def test_another_signature_is_refused_then_replaced_and_rolled_back(
    location: str, models_dir: Path, tmp_path: Path
) -> None:
    # GIVEN the demo's digits as v1 and a graph with another signature
    repository = demo_digits(models_dir, location)
    before = repository.read_config("digits")
    other = graphs.dense(tmp_path / "other.onnx")
    # WHEN it is added under the same name
    refused = models("add", str(other), "--name", "digits", "--repository", location)
    # THEN it is refused in one line listing each difference, exit 2, nothing written
    assert refused.exit_code == 2, refused.output
    assert refused.stdout == ""
    assert refused.stderr.count("\n") == 1
    for difference in (
        "kind image_classifier -> tensor",
        "input 'image' FP32 [-1, 8, 8] is gone",
        "output 'label' INT64 [-1, 1] is gone",
        "output 'probabilities' FP32 [-1, 10] is gone",
        "new input 'x' FP32 [-1, 4]",
        "new output 'y' FP32 [-1, 3]",
        "--replace-signature",
    ):
        assert difference in refused.stderr
    assert repository.list_versions("digits") == [1]
    assert repository.read_config("digits") == before
    # WHEN it is added with --replace-signature
    replaced = models(
        "add",
        str(other),
        "--name",
        "digits",
        "--repository",
        location,
        "--replace-signature",
        *ROOMY_P99,
    )
    # THEN the differences come first, then it is published as v2 and served alone
    assert replaced.exit_code == 0, replaced.output
    lines = replaced.stdout.splitlines()
    assert lines[0] == "digits: replacing the signature served (v1) with other.onnx's:"
    assert "  kind image_classifier -> tensor" in lines[1:7]
    assert lines[7].startswith("digits v2 written to ")
    assert served(repository, "digits") == [2]
    # AND list shows both versions, the served one, kind and signature
    row = listing(location)["digits"]
    assert (row["versions"], row["served"], row["default"]) == ([1, 2], [2], 2)
    assert row["kind"] == "tensor"
    assert row["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    assert row["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 3]}]
    # WHEN it is rolled back
    rolled = models("rollback", "digits", "--repository", location)
    # THEN v1 is served again, under the configuration it was served under
    assert rolled.exit_code == 0, rolled.output
    assert rolled.stdout.splitlines()[0].startswith(
        "digits: served v2 -> v1 (version_policy latest 1 -> specific [1])"
    )
    assert "kind tensor -> image_classifier" in rolled.stdout
    assert served(repository, "digits") == [1]
    assert repository.read_config("digits").spillway.kind == "image_classifier"
    assert_serves_digits(repository, models_dir, tmp_path)
    # AND --to 2 serves v2 again under its own signature; no version's files changed
    forward = models("rollback", "digits", "--to", "2", "--repository", location)
    assert forward.exit_code == 0, forward.output
    assert served(repository, "digits") == [2]
    assert [t.name for t in repository.read_config("digits").input] == ["x"]
    assert repository.list_versions("digits") == [1, 2]


def test_a_file_with_the_served_signature_keeps_the_configuration(
    models_dir: Path, tmp_path: Path
) -> None:
    # GIVEN the demo's digits (kind, image input, batching) in a folder repository
    location = str(tmp_path / "repo")
    repository = demo_digits(models_dir, location)
    before = repository.read_config("digits")
    # WHEN the demo's own file is added again
    added = models(
        "add", str(models_dir / "digits/1/model.onnx"), "--name", "digits", "--repository", location
    )
    # THEN v2 keeps the configuration whole: no profile, no new batching, v2 served
    assert added.exit_code == 0, added.output
    assert (
        "kept the served configuration of digits: kind image_classifier, max_batch_size 64, "
        "preferred_batch_size [16, 32], max_queue_delay_microseconds 2000"
    ) in added.stdout.splitlines()
    assert "profile (" not in added.stdout
    assert repository.read_config("digits") == before
    assert served(repository, "digits") == [2]
    assert_serves_digits(repository, models_dir, tmp_path)


def test_show_and_remove(location: str, models_dir: Path, tmp_path: Path) -> None:
    # GIVEN digits v1 and v2 (the same file again), v2 served
    repository = demo_digits(models_dir, location)
    graph = str(models_dir / "digits/1/model.onnx")
    assert models("add", graph, "--name", "digits", "--repository", location).exit_code == 0
    # WHEN it is shown
    shown = models("show", "digits", "--repository", location)
    # THEN configuration, policy, signature and each version's checksums are printed
    assert shown.exit_code == 0, shown.output
    text = shown.stdout
    assert "kind image_classifier, max_batch_size 64, dynamic batching" in text
    assert "version_policy latest 1: serves v2; a request naming no version gets v2" in text
    assert "inputs:  image FP32 [-1, 8, 8]" in text
    digest = repository.version_records("digits")[0].checksums["model.onnx"]
    assert f"        {digest}  model.onnx" in text
    assert re.search(r"^    v2  \S+ \S+  served, default$", text, re.MULTILINE)
    # WHEN the only served version is to be removed THEN refused, nothing removed
    only = models("remove", "digits", "--version", "2", "--repository", location)
    assert only.exit_code == 1
    assert "v2 is the only version digits serves: serve another first" in only.stderr
    assert repository.list_versions("digits") == [1, 2]
    # WHEN v1 is removed THEN v2 stays served, and show marks v1 removed
    removed = models("remove", "digits", "--version", "1", "--repository", location)
    assert removed.exit_code == 0, removed.output
    assert repository.list_versions("digits") == [2]
    assert served(repository, "digits") == [2]
    document = json.loads(models("show", "digits", "--repository", location, "--json").stdout)
    assert [(r["version"], r["removed"] is not None) for r in document["records"]] == [
        (1, True),
        (2, False),
    ]
    # AND v1's number is never given again: the next version is v3
    again = models("add", graph, "--name", "digits", "--repository", location)
    assert "digits v3 written to" in again.stdout
    # WHEN the whole model is removed: refused without --yes, then gone
    assert models("remove", "digits", "--repository", location).exit_code == 1
    gone = models("remove", "digits", "--yes", "--repository", location)
    assert gone.exit_code == 0, gone.output
    assert gone.stdout.startswith("removed digits from ")
    assert repository.list_models() == []
    assert listing(location) == {}


def test_a_deployed_stack_names_its_repository(aws_env: str, models_dir: Path) -> None:
    # GIVEN a storage stack with a models bucket and an app stack naming it (CloudFormation
    # on the moto server), digits in that bucket under the app's ModelsPrefix
    cloudformation = boto3.client("cloudformation")
    suffix = abs(hash(aws_env)) % 10**6
    storage, application = f"storage-{suffix}", f"app-{suffix}"
    cloudformation.create_stack(
        StackName=storage,
        TemplateBody=json.dumps(
            {
                "Resources": {"ModelsBucket": {"Type": "AWS::S3::Bucket"}},
                "Outputs": {"ModelsBucket": {"Value": {"Ref": "ModelsBucket"}}},
            }
        ),
    )
    cloudformation.create_stack(
        StackName=application,
        TemplateBody=json.dumps(
            {
                "Parameters": {
                    "StorageStack": {"Type": "String"},
                    "ModelsPrefix": {"Type": "String", "Default": "models"},
                },
                "Resources": {"Queue": {"Type": "AWS::SQS::Queue"}},
            }
        ),
        Parameters=[
            {"ParameterKey": "StorageStack", "ParameterValue": storage},
            {"ParameterKey": "ModelsPrefix", "ParameterValue": "served"},
        ],
    )
    outputs = cloudformation.describe_stacks(StackName=storage)["Stacks"][0]["Outputs"]
    bucket = outputs[0]["OutputValue"]
    demo_digits(models_dir, f"s3://{bucket}/served")
    # WHEN the models of the app stack are listed
    result = models("list", "--stack", application)
    # THEN they are the bucket's, under its prefix
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[1].split()[:4] == ["digits", "image_classifier", "1", "1"]
    # AND a stack without a models bucket is one line
    missing = models("list", "--stack", f"nothing-{suffix}")
    assert missing.exit_code == 1
    assert missing.stderr.startswith("error: AWS refused DescribeStacks: ValidationError")
    assert missing.stderr.count("\n") == 1


def test_publish_without_credentials_is_one_line(tmp_path: Path) -> None:
    # GIVEN no stack, no AWS credentials anywhere, and a version to publish to S3
    graph = graphs.dense(tmp_path / "model.onnx")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "SPILLWAY_"))}
    env |= {
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_DEFAULT_REGION": "us-east-1",
        "SPILLWAY_STACK_ENV": str(tmp_path / "no-stack.json"),
    }
    argv = [sys.executable, "-m", "spillway_cli.main", "models", "publish"]
    argv += ["--repository", "s3://spillway-models/repository", "--model", "dense"]
    argv += ["--file", str(graph)]
    # WHEN it is published
    done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    # THEN one line says what failed and what to do, exit 1, no traceback
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith("error: no local stack runs")
    assert "start one with `spillway up`, or set AWS_REGION and credentials" in done.stderr


def test_an_s3_error_is_one_line(aws_env: str, tmp_path: Path) -> None:
    # GIVEN credentials but a bucket that does not exist
    graph = graphs.dense(tmp_path / "model.onnx")
    # WHEN a version is published there
    result = models(
        "publish",
        "--repository",
        "s3://no-such-bucket-35/models",
        "--model",
        "dense",
        "--file",
        str(graph),
    )
    # THEN S3's refusal is one line, exit 1
    assert result.exit_code == 1
    assert isinstance(result.exception, SystemExit)
    assert result.stderr.startswith("error: AWS refused GetObject: NoSuchBucket")
    assert result.stderr.count("\n") == 1


def _spillway(cwd: Path, env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    """``spillway ARGV`` as a user runs it in ``cwd``: none of the stack's variables set."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SPILLWAY_", "AWS_"))}
    return subprocess.run(
        [sys.executable, "-m", "spillway_cli.main", *argv],
        cwd=cwd,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_add_from_another_folder_without_a_stack_writes_nothing(tmp_path: Path) -> None:
    # GIVEN a folder where no stack runs and a graph there
    graph = graphs.dense(tmp_path / "mine.onnx")
    # WHEN it is added with --load and no --gpu-url
    done = _spillway(tmp_path, {}, "models", "add", str(graph), "--name", "mine", "--load")
    # THEN one line says how to reach the stack, and nothing was written
    assert done.returncode == 1, done.stdout
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith("error: --load needs the GPU service: pass --gpu-url; ")
    assert "set SPILLWAY_STACK_ENV to its env.json); nothing was written" in done.stderr
    assert not (tmp_path / "models").exists()


def test_add_from_another_folder_reaches_the_stack_through_its_env_file(
    tmp_path: Path,
) -> None:
    # GIVEN a stack's repository and GPU service, its env file (this process plays the
    # stack), and a user in another folder who names the file
    from spillway_cli.local.stackenv import PATH_VARIABLE, write_stack_env

    repo = tmp_path / "stack" / "models"
    repo.mkdir(parents=True)
    elsewhere = tmp_path / "exports"
    graph = graphs.dense(elsewhere / "mine.onnx")
    live = "/v2/health/live"  # ready only once it serves a model
    with gpu_service(repo, tmp_path / "logs", live, model_control_mode="explicit") as service:
        values = {"SPILLWAY_REPOSITORY": str(repo), "SPILLWAY_GPU_URL": service.base}
        stack_file = write_stack_env(tmp_path / "stack" / "out/stack/env.json", values)
        env = {PATH_VARIABLE: str(stack_file)}
        # WHEN the user adds a model with --load, then lists the models
        added = _spillway(elsewhere, env, "models", "add", str(graph), "--name", "mine", "--load")
        listed = _spillway(elsewhere, env, "models", "list", "--json")
    # THEN the version went to the stack's repository and its GPU service loaded it
    assert added.returncode == 0, added.stderr
    assert added.stdout.splitlines()[0] == f"mine v1 written to {repo}"
    assert added.stdout.splitlines()[-1] == f"mine: ready on {service.base}"
    assert not (elsewhere / "models").exists()
    assert [row["name"] for row in json.loads(listed.stdout)] == ["mine"]


def _ready(base: str, path: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}{path}", timeout=10) as answer:
            return bool(answer.status == 200)
    except urllib.error.HTTPError:
        return False


def test_rollback_and_removal_reach_the_running_gpu_service(tmp_path: Path) -> None:
    # GIVEN dense v1 and v2 (the same signature), and a GPU service serving v2
    location = tmp_path / "repo"
    graph = graphs.dense(tmp_path / "dense.onnx")
    for _ in range(2):
        added = models("add", str(graph), "--name", "dense", "--repository", str(location))
        assert added.exit_code == 0, added.output
    with gpu_service(location, tmp_path / "logs", model_control_mode="explicit") as service:
        assert gpu_call(service.base, "dense", "load") == (True, "")
        assert _ready(service.base, "/v2/models/dense/versions/2/ready")
        # WHEN dense is rolled back, naming that service
        rolled = models(
            "rollback", "dense", "--repository", str(location), "--gpu-url", service.base
        )
        # THEN the service serves v1 and has retired v2
        assert rolled.exit_code == 0, rolled.output
        assert rolled.stdout.splitlines()[-1] == f"gpu: {service.base} loaded the change"
        assert _ready(service.base, "/v2/models/dense/versions/1/ready")
        assert not _ready(service.base, "/v2/models/dense/versions/2/ready")
        # WHEN the whole model is removed THEN the service unloads it
        gone = models(
            "remove", "dense", "--yes", "--repository", str(location), "--gpu-url", service.base
        )
        assert gone.exit_code == 0, gone.output
        assert not _ready(service.base, "/v2/models/dense/ready")
