"""The local stack (moto, GPU service, CPU fallback, jobs API, router) for the e2e tier."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from spillway_cli.local.serverless_offline import offline_missing
from spillway_cli.local.stack import LocalStack


@pytest.fixture(scope="session")
def stack(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """The whole platform on free ports of 127.0.0.1, stopped by PID at the end."""
    local = LocalStack(models_dir, tmp_path_factory.mktemp("stack"))
    local.start()
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture
def offline_stack(models_dir: Path, tmp_path: Path) -> Iterator[LocalStack]:
    """A second stack whose router (and WebSocket function) run under serverless-offline
    (serverless.yml, stage ``local``), skipped when its tools are missing; the process
    environment it sets is put back after it stops."""
    missing = offline_missing()
    if missing:
        pytest.skip(f"serverless-offline needs {', '.join(missing)}")
    saved = dict(os.environ)
    local = LocalStack(models_dir, tmp_path, router_runtime="serverless-offline")
    try:
        local.start()
        yield local
    finally:
        local.stop()
        os.environ.clear()
        os.environ.update(saved)
