"""Fixtures for the integration tier: a serving repository and a shared GPU service."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import Service, gpu_service, link_model, write_slow_model


@pytest.fixture(scope="session")
def serving_repo(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """digits, minilm and mlp-bench plus a slow model, in one repository."""
    root = tmp_path_factory.mktemp("serving-repo")
    for name in ("digits", "minilm", "mlp-bench"):
        link_model(models_dir, root, name)
    write_slow_model(root)
    return root


@pytest.fixture(scope="session")
def service(serving_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """One GPU service for the read-mostly tests of a session."""
    with gpu_service(serving_repo, tmp_path_factory.mktemp("logs")) as svc:
        yield svc
