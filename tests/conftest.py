"""Shared fixtures: the built model repository and a moto server on 127.0.0.1."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

AWS_REGION = "us-east-1"


def pytest_configure(config: pytest.Config) -> None:
    """No test finds a stack it did not start: the spillway commands a test runs read the
    stack env file ``SPILLWAY_STACK_ENV`` names, a path no stack writes unless the test
    names it (a developer's ``spillway up`` in this folder, or anywhere through the
    registry of running stacks, would otherwise answer the commands a test runs)."""
    import tempfile

    nowhere = Path(tempfile.mkdtemp(prefix="spillway-tests-")) / "no-stack" / "env.json"
    os.environ["SPILLWAY_STACK_ENV"] = str(nowhere)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository `make models` built, or a fresh build when there is none."""
    configured = os.environ.get("SPILLWAY_MODELS_DIR")
    if configured and (Path(configured) / ".built").is_file():
        return Path(configured)
    from spillway_cli.modelbuild.build import build_repository

    out = tmp_path_factory.mktemp("models")
    build_repository(out)
    return out


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """A real moto server (HTTP on 127.0.0.1, a free port) for the whole session, its
    DynamoDB item writes atomic as DynamoDB's."""
    from moto.server import ThreadedMotoServer

    from spillway_cli.local.moto_atomic import atomic_dynamodb

    atomic_dynamodb()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def aws_env(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """boto3's standard variables pointed at the moto server, with dummy credentials."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", AWS_REGION)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return moto_endpoint
