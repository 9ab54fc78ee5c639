"""Pydantic models of the Open Inference Protocol (KServe V2) REST messages.

The models describe the JSON header only; tensor contents stay opaque here (``data`` is
``Any``) and ``spillway.protocol.codec`` turns them into numpy arrays. Unknown top-level fields are
ignored, as a tolerant reader should; the spec's extension point is ``parameters``, an
open mapping everywhere it appears.

An unknown ``datatype`` raises ``UnsupportedDatatypeError`` straight out of validation
(pydantic lets non-``ValueError`` exceptions through), so transports answer it with its
own code rather than a generic validation failure.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictStr

from spillway.protocol.datatypes import numpy_dtype

Parameters = dict[str, Any]
"""Free-form ``parameters``: the protocol's extension point (Triton puts ``binary_data_size``,
``binary_data``, ``binary_data_output``, ``priority`` and ``timeout`` here)."""

# Strict so that "3", 3.0 or true never pass as a dimension. Bounded so that no shape a
# client sends can make numpy fail (more than 64 dimensions, or a huge dimension beside a
# zero one): a shape is the client's to get right, never a server error.
MAX_DIM = 2**31 - 1
MAX_RANK = 16
Dim = Annotated[int, Field(strict=True, ge=0, le=MAX_DIM)]


def _bounded_extent(shape: list[int]) -> list[int]:
    # Zero dimensions aside: numpy refuses [0, 2**31, 2**31] as surely as [2**31, 2**31].
    if math.prod(d for d in shape if d) > MAX_DIM:
        raise ValueError(f"a shape may hold at most {MAX_DIM} elements")
    return shape


Shape = Annotated[list[Dim], Field(max_length=MAX_RANK), AfterValidator(_bounded_extent)]
MetadataDim = Annotated[int, Field(strict=True, ge=-1)]
Name = Annotated[StrictStr, Field(min_length=1, max_length=256)]


def _known_datatype(value: str) -> str:
    numpy_dtype(value)  # raises UnsupportedDatatypeError
    return value


Datatype = Annotated[StrictStr, AfterValidator(_known_datatype)]


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RequestInput(_Message):
    """One input tensor: ``data`` (flat or nested, row-major) or, with the binary
    extension, ``parameters.binary_data_size`` bytes after the JSON header."""

    name: Name
    shape: Shape
    datatype: Datatype
    parameters: Parameters | None = None
    data: Any | None = None


class RequestOutput(_Message):
    """An output the client asks for; ``parameters.binary_data`` picks its encoding."""

    name: Name
    parameters: Parameters | None = None


class InferenceRequest(_Message):
    """``POST /v2/models/{m}[/versions/{v}]/infer`` body (JSON header part)."""

    id: StrictStr | None = None
    parameters: Parameters | None = None
    inputs: list[RequestInput] = Field(min_length=1)
    outputs: list[RequestOutput] | None = None


class ResponseOutput(_Message):
    """One output tensor of an inference response."""

    name: Name
    shape: Shape
    datatype: Datatype
    parameters: Parameters | None = None
    data: Any | None = None


class InferenceResponse(_Message):
    """The inference response (JSON header part)."""

    model_name: StrictStr
    model_version: StrictStr | None = None
    id: StrictStr | None = None
    parameters: Parameters | None = None
    outputs: list[ResponseOutput] = Field(default_factory=list)


class MetadataTensor(_Message):
    """A tensor in model metadata; ``-1`` marks a variable dimension (and the batch one)."""

    name: Name
    datatype: Datatype
    shape: list[MetadataDim]


class MetadataModelResponse(_Message):
    """``GET /v2/models/{m}[/versions/{v}]``."""

    name: StrictStr
    versions: list[StrictStr] = Field(default_factory=list)
    platform: StrictStr
    inputs: list[MetadataTensor] = Field(default_factory=list)
    outputs: list[MetadataTensor] = Field(default_factory=list)
    parameters: Parameters | None = None


class MetadataServerResponse(_Message):
    """``GET /v2``."""

    name: StrictStr
    version: StrictStr
    extensions: list[StrictStr] = Field(default_factory=list)


def server_metadata(name: str, extensions: list[str]) -> dict[str, Any]:
    """``GET /v2`` of a Spillway server, through the protocol's response model."""
    from spillway import __version__

    return MetadataServerResponse(
        name=name, version=__version__, extensions=extensions
    ).model_dump()
