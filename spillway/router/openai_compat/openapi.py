"""The OpenAI-compatible paths in the router's OpenAPI document (``/openapi.json``).

Only what the door answers: each status listed is one it (or a backend through it) can
return, every error in OpenAI's shape with Spillway's stable code.
"""

from __future__ import annotations

from typing import Any

from spillway.protocol.openapi import MODEL_NAME, STRING, obj, ref
from spillway.router.openai_compat.schema import MAX_INPUT_CHARS, MAX_INPUTS, MAX_USER_CHARS

_STATUS_TEXT = {
    400: "A field refused (param names it), bad JSON, a name no model may have, or the "
    "door not configured (ROUTER_MODEL_REPOSITORY unset).",
    404: "No text_embedding model of that name (the message says what the name is).",
    413: "Request body over the size limit.",
    429: "The backend's queue is full; retry after Retry-After seconds.",
    500: "The backend failed to compute the request.",
    503: "No backend can serve now, or the model repository cannot be read.",
    504: "The deadline passed before a backend answered.",
}
_ROUTING_HEADERS = ("x-spillway-rule", "x-spillway-backend", "x-spillway-cost-usd")
_ROUTED = (400, 404, 413, 429, 500, 503, 504)
"""The failures of an embeddings request: the door's own and the routed V2 request's."""


def _json(schema: str) -> dict[str, Any]:
    return {"application/json": {"schema": ref(schema)}}


def _answers(summary: str, schema: str, *statuses: int, routed: bool = False) -> dict[str, Any]:
    headers = {h: {"schema": STRING} for h in _ROUTING_HEADERS} if routed else {}
    ok: dict[str, Any] = {"description": summary, "content": _json(schema)}
    if headers:
        ok["headers"] = headers
    failed = {
        str(s): {"description": _STATUS_TEXT[s], "content": _json("OpenAIError")} for s in statuses
    }
    return {"200": ok, **failed}


def paths() -> dict[str, Any]:
    """``/v1/embeddings``, ``/v1/models`` and ``/v1/models/{id}``."""
    model_id = {"name": "id", "in": "path", "required": True, "schema": MODEL_NAME}
    return {
        "/v1/embeddings": {
            "post": {
                "summary": "Embeddings (OpenAI-compatible), routed as /v2 infer on the model",
                "requestBody": {"required": True, "content": _json("EmbeddingsRequest")},
                "responses": _answers("Embeddings", "EmbeddingsResponse", *_ROUTED, routed=True),
            }
        },
        "/v1/models": {
            "get": {
                "summary": "The text_embedding models (OpenAI-compatible list)",
                "responses": _answers("Models", "ModelList", 400, 503),
            }
        },
        "/v1/models/{id}": {
            "get": {
                "summary": "One text_embedding model (OpenAI-compatible)",
                "parameters": [model_id],
                "responses": _answers("The model", "Model", 400, 404, 503),
            }
        },
    }


def schemas() -> dict[str, Any]:
    """The message schemas of those paths."""
    text = {"type": "string", "minLength": 1, "maxLength": MAX_INPUT_CHARS}
    texts = {"type": "array", "items": text, "minItems": 1, "maxItems": MAX_INPUTS}
    vector = {"type": "array", "items": {"type": "number"}}
    embedding = obj(
        ["object", "index", "embedding"],
        object={"type": "string", "enum": ["embedding"]},
        index={"type": "integer", "minimum": 0},
        embedding={"oneOf": [vector, {"type": "string", "format": "byte"}]},
    )
    usage = obj(
        ["prompt_tokens", "total_tokens"],
        prompt_tokens={"type": "integer", "minimum": 0},
        total_tokens={"type": "integer", "minimum": 0},
    )
    model = obj(
        ["id", "object", "created", "owned_by"],
        id=STRING,
        object={"type": "string", "enum": ["model"]},
        created={"type": "integer"},
        owned_by=STRING,
    )
    request = obj(
        ["model", "input"],
        model=MODEL_NAME,
        input={"oneOf": [text, texts]},
        encoding_format={"type": "string", "enum": ["float", "base64"], "nullable": True},
        dimensions={"type": "integer", "minimum": 1, "nullable": True},
        user={"type": "string", "maxLength": MAX_USER_CHARS, "nullable": True},
    )
    request["additionalProperties"] = False
    error = obj(
        ["message", "type", "param", "code"],
        message=STRING,
        type=STRING,
        param={"type": "string", "nullable": True},
        code=STRING,
    )
    return {
        "EmbeddingsRequest": request,
        "EmbeddingsResponse": obj(
            ["object", "data", "model", "usage"],
            object={"type": "string", "enum": ["list"]},
            data={"type": "array", "items": embedding},
            model=STRING,
            usage=usage,
        ),
        "Model": model,
        "ModelList": obj(
            ["object", "data"],
            object={"type": "string", "enum": ["list"]},
            data={"type": "array", "items": ref("Model")},
        ),
        "OpenAIError": obj(["error"], error=error),
    }
