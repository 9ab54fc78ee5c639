"""How an infer body is framed, and the strict JSON every server reads.

A body is a JSON header, optionally followed by binary tensor data (Triton's binary
extension): ``Inference-Header-Content-Length`` says where the header ends. Here are that
header's name and parser, the split of a body into header and tensor bytes, the two
content types, and the one reader of JSON text (strict UTF-8, a JSON object, no lone
surrogate) that every transport, the router's included, uses alike.

No numpy here: the router imports this module and must stay light.
"""

from __future__ import annotations

import json
import re
from typing import Any

from spillway.protocol.errors import InvalidInputError

HEADER_LENGTH = "inference-header-content-length"
JSON_CONTENT_TYPE = "application/json"
BINARY_CONTENT_TYPE = "application/octet-stream"
# A JSON header longer than this many decimal digits would be larger than any body we take.
_MAX_LENGTH_DIGITS = 12


def parse_header_length(value: str | None) -> int | None:
    """The ``Inference-Header-Content-Length`` value (absent: ``None``): ASCII digits only,
    so ``+368``, ``1_0`` or ``٣`` are refused everywhere alike."""
    if value is None:
        return None
    text = value.strip()
    if not (text.isascii() and text.isdigit() and len(text) <= _MAX_LENGTH_DIGITS):
        raise InvalidInputError("Inference-Header-Content-Length must be a non-negative integer")
    return int(text)


def split_body(body: bytes, header_length: int | None) -> tuple[bytes, memoryview]:
    """The JSON header and the binary tensor data that follows it (empty for JSON)."""
    view = memoryview(body)
    if header_length is None:
        return body, view[len(view) :]
    if not 0 <= header_length <= len(body):
        raise InvalidInputError(
            f"Inference-Header-Content-Length {header_length} is outside the body "
            f"of {len(body)} bytes"
        )
    return bytes(view[:header_length]), view[header_length:]


NOT_UTF8 = "invalid JSON: not UTF-8"
"""The one message for JSON text that is not UTF-8, or that escapes a lone surrogate (a
string no UTF-8 can carry back): every server refuses both alike."""
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def utf8_text(raw: bytes) -> str:
    """JSON text as strict UTF-8 (RFC 8259): undecodable bytes, overlong forms and
    encoded surrogates (``\\xed\\xa0\\x80``) are refused alike, with ``NOT_UTF8``."""
    try:
        return raw.decode("ascii" if raw.isascii() else "utf-8")
    except UnicodeDecodeError:
        raise InvalidInputError(NOT_UTF8) from None


def has_surrogate_escape(raw: bytes) -> bool:
    """Whether JSON text escapes a UTF-16 surrogate (``\\ud83d``, paired or not): such
    text is read the long way, through ``load_json_object``, which refuses a lone one."""
    # A one-byte search first (memchr: a tenth of a millisecond for a 2.6 MB body of
    # numbers); only text with a backslash is searched for the escape itself.
    return b"\\" in raw and _SURROGATE_ESCAPE.search(raw) is not None


def _check_escapes(raw: bytes, value: Any) -> None:
    """Refuse a lone surrogate written as an escape (``\\ud800``): valid JSON, but text no
    answer (or forwarded body) can encode. Only text that has such an escape is walked."""
    if not has_surrogate_escape(raw):
        return
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInputError(NOT_UTF8) from None


def load_json_object(raw: bytes | str) -> dict[str, Any]:
    """A JSON object; anything else (bad JSON, a list, deep nesting, text that is not
    UTF-8 or holds a lone surrogate) is the client's error.

    The bare ``NaN`` and ``Infinity`` that Python's and tritonclient's encoders write are
    read (be tolerant in what you accept); Spillway itself writes them as strings."""
    try:
        data = raw.encode("utf-8") if isinstance(raw, str) else raw
    except UnicodeEncodeError:
        raise InvalidInputError(NOT_UTF8) from None
    try:
        value = json.loads(utf8_text(data))
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"invalid JSON: {exc.msg} at position {exc.pos}") from None
    except RecursionError:
        raise InvalidInputError("invalid JSON: nested too deeply") from None
    except ValueError:  # an integer past Python's digit limit
        raise InvalidInputError("invalid JSON: a number is too long") from None
    if not isinstance(value, dict):
        raise InvalidInputError("the JSON header must be an object")
    _check_escapes(data, value)
    return value


def read_json_header(body: bytes, header_length: int | None) -> dict[str, Any]:
    """The parsed JSON header of an infer body; tensor bytes are never touched."""
    header = load_json_object(split_body(body, header_length)[0])
    parameters = header.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidInputError("parameters must be an object")
    return header
