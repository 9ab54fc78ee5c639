"""Docker and the SAM CLI driven from the tests: the local base images, ``sam build`` of
the zip functions (skipped while its inputs are unchanged), ``sam local invoke`` on the
host's network, and containers of our own images stopped by id."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.sam_local import ROOT, SAM_VENV, Answer, sam_process_env

OUT = ROOT / "build" / "sam-local"
LAMBDA_BASE = "spillway-local/lambda-python:3.12"
CPU_IMAGE = "spillway-local/cpu-infer:latest"
GPU_IMAGE = "spillway-local/gpu-service:cpu"
ZIP_FUNCTIONS = ("RouterFunction", "JobsFunction")
# What `sam build` of a zip function reads (infra/lambda/Makefile's CODE_DIRS, its recipes
# and pins, the template).
BUILD_INPUTS = ("spillway", "functions", "batch_job", "config", "infra/lambda", "template.yaml")


def docker(*args: str, timeout: float = 120, check: bool = True) -> str:
    """Run the docker CLI; its stdout."""
    done = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and done.returncode != 0:
        raise AssertionError(f"docker {' '.join(args[:3])}: {done.stderr[-2000:]}")
    return done.stdout.strip()


def require_docker() -> None:
    """Skip without a Docker daemon, except in CI, which must provide one (.ci/run)."""
    try:
        docker("info", timeout=30)
    except (AssertionError, FileNotFoundError, subprocess.TimeoutExpired) as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run a Docker daemon (.ci/run starts one): {exc}")
        pytest.skip("no Docker daemon (scripts/dockerd.sh start, as root)")


def build_images() -> None:
    """The stand-in base images and our images on them (fast when up to date)."""
    done = subprocess.run(
        ["bash", str(ROOT / "infra/local-images/build.sh")],
        capture_output=True,
        text=True,
        timeout=1500,
        check=False,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def _digest(paths: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for top in paths:
        root = ROOT / top
        files = [root] if root.is_file() else sorted(root.rglob("*"))
        for path in files:
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def sam_build() -> dict[str, Path]:
    """Built templates by function: ``sam build`` of each zip function into its own folder
    (building one clears the others' artefacts), and for the CPU fallback the template
    ``sam build`` would write for its image: ``ImageUri`` set to the image built on the
    stand-in base (``sam build`` cannot pass that build argument itself)."""
    out = OUT / "sam"
    templates = {
        name: out / name / "template.yaml" for name in (*ZIP_FUNCTIONS, "CpuInferFunction")
    }
    stamp = out / ".inputs"
    inputs = _digest(BUILD_INPUTS)
    fresh = stamp.exists() and stamp.read_text() == inputs
    if not (fresh and all(path.exists() for path in templates.values())):
        for name in ZIP_FUNCTIONS:
            done = subprocess.run(
                [
                    str(SAM_VENV / "bin" / "sam"), "build", name, "--cached", "--build-in-source",
                    "--build-dir", str(out / name), "--cache-dir", str(out / "cache"),
                ],
                cwd=ROOT, env=sam_process_env(), capture_output=True, text=True, timeout=900,
                check=False,
            )  # fmt: skip
            assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
        built = yaml.safe_load(templates["RouterFunction"].read_text())
        built["Resources"]["CpuInferFunction"]["Properties"]["ImageUri"] = CPU_IMAGE
        nested = built["Resources"]["Observability"]["Properties"]
        nested["Location"] = str(out / "RouterFunction" / nested["Location"])
        templates["CpuInferFunction"].parent.mkdir(parents=True, exist_ok=True)
        templates["CpuInferFunction"].write_text(yaml.safe_dump(built, sort_keys=False))
        stamp.write_text(inputs)
    # SAM reuses its emulator image of an image function as long as one exists: drop it
    # so this run's image is the one invoked.
    docker("image", "rm", "-f", f"{CPU_IMAGE.split(':')[0]}:rapid-x86_64", check=False)
    return templates


@dataclass(frozen=True)
class Invocation:
    """One ``sam local invoke``: the function's answer (None if it gave none) and SAM's log."""

    answer: Answer | None
    log: str
    seconds: float


def sam_invoke(function: str, template: Path, event: Path, env_vars: Path) -> Invocation:
    """``sam local invoke`` on the host's network (scripts/sam_local/sam.py), so the
    function reaches the local stack at the 127.0.0.1 addresses of the env-vars file."""
    argv = [
        str(SAM_VENV / "bin" / "python"), str(ROOT / "scripts/sam_local/sam.py"),
        "local", "invoke", function, "--template", str(template), "--event", str(event),
        "--env-vars", str(env_vars), "--docker-network", "host", "--skip-pull-image",
        "--region", "us-east-1",
    ]  # fmt: skip
    if function in ZIP_FUNCTIONS:
        argv += ["--invoke-image", LAMBDA_BASE]
    started = time.monotonic()
    done = subprocess.run(
        argv, cwd=ROOT, env=sam_process_env(), capture_output=True, text=True, timeout=600,
        check=False,
    )  # fmt: skip
    try:
        answer: Answer | None = Answer(json.loads(done.stdout)) if done.returncode == 0 else None
    except json.JSONDecodeError:
        answer = None
    return Invocation(answer, done.stdout[-2000:] + done.stderr[-6000:], time.monotonic() - started)


class Container:
    """A detached container of ours; removed by id."""

    def __init__(self, image: str, *args: str, options: tuple[str, ...] = ()) -> None:
        self.name = f"spillway-test-{uuid.uuid4().hex[:10]}"
        self.id = docker("run", "--detach", "--name", self.name, *options, image, *args)

    def inspect(self, template: str) -> str:
        """``docker inspect --format`` of the container."""
        return docker("inspect", "--format", template, self.id)

    def port(self, inner: int) -> int:
        """The host port published for ``inner``."""
        return int(docker("port", self.id, f"{inner}/tcp").splitlines()[0].rsplit(":", 1)[1])

    def logs(self) -> str:
        done = subprocess.run(
            ["docker", "logs", self.id], capture_output=True, text=True, timeout=60, check=False
        )
        return done.stdout + done.stderr

    def exec(self, *args: str) -> str:
        return docker("exec", self.id, *args)

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = json.loads(self.inspect("{{json .State}}"))
        return state

    def remove(self) -> None:
        docker("rm", "--force", self.id, check=False)
