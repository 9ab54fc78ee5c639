"""Settings the core shares across deployables, read from one environment prefix.

A deployable's own settings are pydantic-settings classes; a block that several
deployables read alike (the pipeline step cache, say) is a plain pydantic model in the
core, filled from ``<PREFIX><FIELD>`` variables by the deployable that uses it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel


def prefixed_values(
    model: type[BaseModel], prefix: str, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """``{field: value}`` for each of ``model``'s fields set as ``<prefix><FIELD>`` (an
    empty value counts as unset); ``environ`` defaults to the process environment."""
    env = os.environ if environ is None else environ
    names = {f"{prefix}{name.upper()}": name for name in model.model_fields}
    return {names[key]: value for key, value in env.items() if key in names and value != ""}


def json_mapping(value: Any) -> Any:
    """A mapping setting as the environment gives it: a JSON object (an empty or blank
    string is ``{}``); anything else is left for pydantic to validate."""
    if isinstance(value, str):
        return json.loads(value) if value.strip() else {}
    return value
