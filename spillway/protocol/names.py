"""Model names and versions: validated before any path, key or URL is formed.

Kept free of numpy and onnxruntime so that the router can import it at no cost.
"""

from __future__ import annotations

import re

from spillway.protocol.errors import InvalidModelNameError

MODEL_NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")


def validate_model_name(name: str) -> str:
    """The name itself if it is safe to use as one path component or key segment."""
    if not isinstance(name, str) or not MODEL_NAME_PATTERN.fullmatch(name):
        raise InvalidModelNameError(f"invalid model name {str(name)[:80]!r}")
    return name


def validate_version(version: str | int) -> int:
    """A positive integer version (at most 9 digits), from an int or its decimal string."""
    text = str(version)
    if not text.isascii() or not text.isdigit() or len(text) > 9 or int(text) < 1:
        raise InvalidModelNameError(f"invalid model version {text[:20]!r}")
    return int(text)
