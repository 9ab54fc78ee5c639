"""The README stays true: every setting of every deployable is in its configuration table,
every error code a client can see in its errors table."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

import batch_job.errors
from batch_job.settings import JobsSettings
from functions.cpu_infer.settings import CpuSettings
from functions.router.settings import RouterSettings
from gpu_service.settings import GpuSettings
from spillway.async_inference import AsyncSettings
from spillway.errors import SpillwayError

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


def _codes(cls: type[SpillwayError]) -> set[str]:
    codes = {cls.code}
    for sub in cls.__subclasses__():
        codes |= _codes(sub)
    return codes


def test_every_error_code_is_in_the_errors_table() -> None:
    # GIVEN every error class of the core and the jobs (their module is imported above)
    assert batch_job.errors.JobNotFoundError.code in _codes(SpillwayError)
    errors_table = README.read_text().split("## Errors", 1)[1].split("\n## ", 1)[0]
    # THEN each stable code has its row
    missing = sorted(c for c in _codes(SpillwayError) if f"`{c}`" not in errors_table)
    assert missing == []
