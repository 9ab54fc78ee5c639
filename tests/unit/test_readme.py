"""The README stays true: every setting of every deployable is in its configuration table."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from batch_job.settings import JobsSettings
from functions.cpu_infer.settings import CpuSettings
from functions.router.settings import RouterSettings
from gpu_service.settings import GpuSettings
from spillway.async_inference import AsyncSettings

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.parametrize(
    ("settings", "prefix"),
    [
        (GpuSettings, "GPU_"),
        (RouterSettings, "ROUTER_"),
        (CpuSettings, "CPU_"),
        (JobsSettings, "JOBS_"),
        (AsyncSettings, "ASYNC_"),
    ],
)
def test_every_setting_is_documented(settings: type[BaseModel], prefix: str) -> None:
    text = README.read_text()
    missing = [
        f"{prefix}{name.upper()}"
        for name in settings.model_fields
        if f"`{prefix}{name.upper()}`" not in text
    ]
    assert missing == []


def test_readme_shows_the_two_commands() -> None:
    text = README.read_text()
    assert "make demo" in text
    assert "make test" in text
