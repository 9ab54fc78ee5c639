"""The local stack (moto, GPU service, CPU fallback, jobs API, router) for the e2e tier."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from spillway_cli.stack import LocalStack


@pytest.fixture(scope="session")
def stack(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """The whole platform on free ports of 127.0.0.1, stopped by PID at the end."""
    local = LocalStack(models_dir, tmp_path_factory.mktemp("stack"))
    local.start()
    try:
        yield local
    finally:
        local.stop()
