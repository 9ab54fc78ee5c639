"""Right after the stack is up, the ``spillway`` commands find it with no flag and no
variable (its stack env file, found where ``spillway up`` writes it), and the lines the
stack prints to try work as printed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from spillway.aws.clients import aws_client
from spillway.canary.records import CanaryStore
from spillway.state.table import DynamoStateStore
from spillway_cli.local.names import DATA_BUCKET, REGION, STATE_TABLE
from spillway_cli.local.stack import LocalStack
from spillway_cli.local.stackenv import read_stack_env
from tests.support import load_engine

OWN_PREFIXES = ("AWS_", "ROUTER_", "JOBS_", "ASYNC_", "SPILLWAY_", "CPU_", "GPU_")


@pytest.fixture
def user_dir(stack: LocalStack, tmp_path: Path) -> Path:
    """A working folder where ``out/stack`` is the stack's folder, as after `spillway up`
    (no models/ folder here: the jobs must use the stack's repository)."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "stack").symlink_to(stack.stack_env_path.parent)
    return tmp_path


def _spillway(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The command as a user runs it: none of the stack's variables in the environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(OWN_PREFIXES)}
    return subprocess.run(
        [sys.executable, "-m", "spillway_cli.main", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_env_file_names_the_running_stack(stack: LocalStack) -> None:
    env = read_stack_env(stack.stack_env_path)
    assert env["AWS_ENDPOINT_URL"] == stack.url("moto")
    assert env["ROUTER_STATE_TABLE"] == STATE_TABLE
    assert env["SPILLWAY_ROUTER_URL"] == stack.url("router")


def test_models_status_and_canary_need_no_flags(stack: LocalStack, user_dir: Path) -> None:
    # GIVEN a canary record of a model of this test's own in the stack's state table
    model = f"stackenv-{int(time.time() * 1000) % 10**8}"
    store = CanaryStore(
        DynamoStateStore(STATE_TABLE, lambda: aws_client("dynamodb", REGION)), time.time
    )
    store.start(model, 2, 10, stable=1)
    # WHEN `models status` and `models canary --percent 100` run with no flags
    status = _spillway(user_dir, "models", "status", model)
    raised = _spillway(user_dir, "models", "canary", "--model", model, "--percent", "100")
    # THEN both reach the stack's table: the record, then the canary in force raised
    assert status.returncode == 0, status.stderr
    assert status.stdout.splitlines()[0] == f"{model}: stable v1, canary v2 at 10% (running)"
    assert raised.returncode == 0, raised.stderr
    assert raised.stdout.splitlines()[0] == f"{model}: stable v1, canary v2 at 100% (running)"
    state = store.load(model)
    assert state is not None
    assert state.percent == 100


def test_jobs_submit_and_status_by_short_id_need_no_flags(
    stack: LocalStack, user_dir: Path, models_dir: Path
) -> None:
    # GIVEN three digits records in the stack's data bucket
    images = np.load(models_dir / "digits/samples/images.npy")[:3]
    lines = [
        json.dumps({"id": f"r{i}", "data": {"image": x.tolist()}}) for i, x in enumerate(images)
    ]
    aws_client("s3", REGION).put_object(
        Bucket=DATA_BUCKET, Key="stackenv/in/a.jsonl", Body="\n".join(lines).encode()
    )
    # WHEN a job is submitted with no flags but its locations, then asked for by short id
    submitted = _spillway(
        user_dir,
        "jobs",
        "submit",
        "--model",
        "digits",
        "--input",
        f"s3://{DATA_BUCKET}/stackenv/in/",
        "--output",
        f"s3://{DATA_BUCKET}/stackenv/out/",
    )
    assert submitted.returncode == 0, submitted.stderr
    job = json.loads(submitted.stdout)["job"]
    status = _spillway(user_dir, "jobs", "status", job["job_id"][:8])
    # THEN the job was planned from the stack's repository (there is no models/ here) and
    # the short id finds it
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["job_id"] == job["job_id"]
    assert json.loads(status.stdout)["model"] == "digits"


def _printed(stack: LocalStack, start: str) -> str:
    lines = [line.strip() for line in stack.summary().splitlines()]
    return next(line for line in lines if line.startswith(start))


def test_the_printed_tritonclient_line_infers_as_printed(
    stack: LocalStack, models_dir: Path
) -> None:
    # GIVEN the tritonclient line the stack prints
    line = _printed(stack, ".venv/bin/python")
    # WHEN run as printed, in a shell
    done = subprocess.run(  # noqa: S602 - the line under test is a shell line
        line, shell=True, capture_output=True, text=True, timeout=120, check=False
    )
    # THEN it prints digits' label for its input, as ONNX Runtime computes it
    assert done.returncode == 0, done.stderr
    direct = load_engine(models_dir, "digits").infer({"image": np.full((1, 8, 8), 8, np.float32)})
    assert [int(n) for n in re.findall(r"-?\d+", done.stdout)] == direct["label"].ravel().tolist()


def test_the_printed_curl_line_infers_as_printed(stack: LocalStack, models_dir: Path) -> None:
    # GIVEN the curl line the stack prints
    line = _printed(stack, "curl -s")
    # WHEN run as printed, in a shell
    done = subprocess.run(  # noqa: S602 - the line under test is a shell line
        line, shell=True, capture_output=True, text=True, timeout=120, check=False
    )
    # THEN the router answers 200 with minilm's embedding of the text, as ONNX Runtime
    # computes it
    assert done.returncode == 0, done.stderr
    head, _, body = done.stdout.replace("\r\n", "\n").partition("\n\n")
    assert head.splitlines()[0].split()[1] == "200"
    output = next(o for o in json.loads(body)["outputs"] if o["name"] == "embedding")
    text = np.array([[b"hello from spillway"]], dtype=np.object_)
    direct = load_engine(models_dir, "minilm").infer({"text": text})["embedding"]
    np.testing.assert_allclose(
        np.array(output["data"], np.float32).reshape(output["shape"]), direct, atol=1e-5
    )
