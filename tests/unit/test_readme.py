"""The README stays true: every setting of every deployable is in its configuration table."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

from gpu_service.settings import GpuSettings

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.parametrize(("settings", "prefix"), [(GpuSettings, "GPU_")])
def test_every_setting_is_documented(settings: type[BaseSettings], prefix: str) -> None:
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
