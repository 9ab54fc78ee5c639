"""OpenAI's embeddings and models shapes, and the V2 request and answer they map to.

A ``POST /v1/embeddings`` body is read as strictly as a V2 one: the core's JSON reader
(no bare NaN, lone surrogates or deep nesting), then a strict model (no coercion, no
unknown fields, bounded lengths). Its texts become one V2 infer request on the same
model, one text per row of the model's BYTES input; the answer's vectors come back as
JSON numbers as the backend wrote them (``float``) or as the base64 of their
little-endian float32 bytes (``base64``, what the ``openai`` client decodes), and its
``token_count`` (``spillway.protocol.wire.TOKEN_COUNT``) is the usage.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from spillway.protocol.errors import InferenceError, InvalidInputError, SpillwayError
from spillway.protocol.framing import load_json_object
from spillway.protocol.replies import json_bytes
from spillway.protocol.wire import TOKEN_COUNT
from spillway.router.openai_compat.catalog import OWNER, EmbeddingModel

MAX_INPUTS = 2048
"""The most texts any request may list (OpenAI's own bound); a model's ``max_batch_size``
bounds them further."""
MAX_INPUT_CHARS = 65_536
"""The longest text. A model reads at most its ``max_sequence_length`` tokens of a text
(256 for minilm, about 1,000-1,500 characters of English) and ignores the rest, as on
``/v2``; the bound keeps the tokenising of what it ignores small."""
MAX_USER_CHARS = 256
"""The longest ``user``, which is accepted and not used."""

Text = Annotated[str, Field(min_length=1, max_length=MAX_INPUT_CHARS)]


class FieldRefused(Exception):
    """A request field the door refuses: the core error it is answered with, and the
    field's name (OpenAI's ``param``)."""

    def __init__(self, param: str, error: SpillwayError) -> None:
        super().__init__(error.message)
        self.param = param
        self.error = error


class EmbeddingsRequest(BaseModel):
    """``POST /v1/embeddings``: OpenAI's fields, nothing else, each checked strictly."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    model: str = Field(min_length=1, max_length=128)
    input: list[Text] = Field(min_length=1, max_length=MAX_INPUTS)
    """One text, or a list of texts; a text alone is read as a list of one."""
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)

    @field_validator("input", mode="before")
    @classmethod
    def _texts(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and any(
            isinstance(item, int | list) and not isinstance(item, bool) for item in value
        ):
            raise ValueError(
                "token id arrays are not accepted: send the text itself (a string or a "
                "list of strings); the model tokenises it with its own tokenizer"
            )
        return value

    @field_validator("input")
    @classmethod
    def _not_blank(cls, texts: list[str]) -> list[str]:
        blank = next((i for i, text in enumerate(texts) if not text.strip()), None)
        if blank is not None:
            raise ValueError(f"text {blank} is empty or only white space")
        return texts


def read_request(body: bytes) -> EmbeddingsRequest:
    """The request ``body`` holds; a bad field is ``FieldRefused`` naming it and saying
    why (never the validator's internals or the input), bad JSON a 400."""
    document = load_json_object(body)
    try:
        return EmbeddingsRequest.model_validate(document)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(part) for part in first["loc"])
        error = (first.get("ctx") or {}).get("error")
        reason = str(error) if first["type"] == "value_error" and error else first["msg"]
        param = str(first["loc"][0]) if first["loc"] else "body"
        raise FieldRefused(param, InvalidInputError(f"{where or 'body'}: {reason}")) from None


def v2_request(model: EmbeddingModel, texts: Sequence[str]) -> bytes:
    """The V2 infer body of ``texts`` on ``model``: one text per row, its vector output."""
    tensor = {"name": model.text_input, "shape": [len(texts), 1], "datatype": "BYTES"}
    outputs = [{"name": model.output}]
    return json_bytes({"inputs": [{**tensor, "data": list(texts)}], "outputs": outputs})


def read_answer(body: bytes, model: EmbeddingModel, rows: int) -> tuple[list[list[float]], int]:
    """The vectors (one per text, in order) and the token count of a backend's V2 answer;
    an answer that does not hold them is the server's fault (500 ``inference_failed``)."""
    try:
        document = load_json_object(body)
    except InvalidInputError:
        raise InferenceError("the backend's answer is not a JSON infer response") from None
    outputs = document.get("outputs")
    named = (o for o in outputs if isinstance(o, dict)) if isinstance(outputs, list) else ()
    output = next((o for o in named if o.get("name") == model.output), None)
    if output is None or output.get("datatype") != "FP32":
        raise InferenceError(f"the backend's answer has no FP32 output {model.output!r}")
    if output.get("shape") != [rows, model.dimensions]:
        raise InferenceError(
            f"the backend's answer has shape {output.get('shape')}, "
            f"expected {[rows, model.dimensions]}"
        )
    flat = _numbers(output.get("data"))
    if len(flat) != rows * model.dimensions:
        raise InferenceError("the backend's answer holds the wrong number of values")
    tokens = (document.get("parameters") or {}).get(TOKEN_COUNT)
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise InferenceError(
            f"the backend's answer carries no {TOKEN_COUNT} (a server older than the router?)"
        )
    size = model.dimensions
    return [flat[i * size : (i + 1) * size] for i in range(rows)], tokens


_END = object()


def _numbers(data: Any) -> list[float]:
    """V2 JSON data, flat or nested, as a flat list of numbers."""
    if not isinstance(data, list):
        raise InferenceError("the backend's answer has no data")
    flat: list[float] = []
    stack = [iter(data)]
    while stack:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
        elif isinstance(item, list):
            stack.append(iter(item))
        elif isinstance(item, int | float) and not isinstance(item, bool):
            flat.append(float(item))
        else:
            raise InferenceError("the backend's answer holds a value that is not a number")
    return flat


def float32_base64(vector: Sequence[float]) -> str:
    """A vector as the base64 of its little-endian float32 bytes (OpenAI's ``base64``)."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def embeddings_body(
    model: str, vectors: Sequence[list[float]], encoding: str | None, tokens: int
) -> dict[str, Any]:
    """OpenAI's embeddings list for ``vectors`` (``encoding`` ``base64`` or float)."""
    base64_wanted = encoding == "base64"
    data = [
        {
            "object": "embedding",
            "index": index,
            "embedding": float32_base64(vector) if base64_wanted else vector,
        }
        for index, vector in enumerate(vectors)
    ]
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


def model_object(model: EmbeddingModel) -> dict[str, Any]:
    """OpenAI's model object."""
    return {"id": model.name, "object": "model", "created": model.created, "owned_by": OWNER}


def models_body(models: Sequence[EmbeddingModel]) -> dict[str, Any]:
    """OpenAI's models list."""
    return {"object": "list", "data": [model_object(m) for m in models]}
