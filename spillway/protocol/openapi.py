"""OpenAPI building blocks of the Open Inference Protocol, shared by every transport that
documents it (the GPU service, the router). Plain dictionaries: no web framework."""

from __future__ import annotations

from typing import Any

# "stats" is not a model name: /v2/models/stats is the statistics of every model.
MODEL_NAME: dict[str, Any] = {"type": "string", "pattern": "^(?!stats$)[a-z0-9][a-z0-9._-]{0,63}$"}
MODEL_VERSION: dict[str, Any] = {"type": "string", "pattern": "^[1-9][0-9]{0,8}$"}
STRING: dict[str, Any] = {"type": "string"}
BINARY: dict[str, Any] = {"type": "string", "format": "binary"}
ERROR_CONTENT: dict[str, Any] = {
    "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}
}
HEADER_LENGTH_PARAMETER: dict[str, Any] = {
    "name": "Inference-Header-Content-Length",
    "in": "header",
    "required": False,
    "schema": {"type": "integer", "minimum": 0},
    "description": "Length of the JSON header of a binary (Triton extension) body.",
}

_TENSOR = {
    "type": "object",
    "required": ["name", "shape", "datatype"],
    "properties": {
        "name": STRING,
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "datatype": STRING,
        "parameters": {"type": "object"},
        "data": {},
    },
}
_META_TENSOR = {
    "type": "object",
    "required": ["name", "datatype", "shape"],
    "properties": {
        "name": STRING,
        "datatype": STRING,
        "shape": {"type": "array", "items": {"type": "integer"}},
    },
}


def ref(schema: str) -> dict[str, str]:
    """A reference to a component schema."""
    return {"$ref": f"#/components/schemas/{schema}"}


def obj(required: list[str], **properties: Any) -> dict[str, Any]:
    """An object schema (OpenAPI 3.0 wants a non-empty ``required`` or none)."""
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


def path_parameters(versioned: bool) -> list[dict[str, Any]]:
    """``{model}`` and, for versioned paths, ``{version}``."""
    params = [{"name": "model", "in": "path", "required": True, "schema": MODEL_NAME}]
    if versioned:
        params.append({"name": "version", "in": "path", "required": True, "schema": MODEL_VERSION})
    return params


def schemas(request_parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    """The V2 message schemas; ``request_parameters`` documents the infer parameters."""
    return {
        "Error": obj(["error"], error=STRING, code=STRING),
        "InferenceRequest": obj(
            ["inputs"],
            id=STRING,
            parameters=request_parameters or {"type": "object"},
            inputs={"type": "array", "minItems": 1, "items": _TENSOR},
            outputs={"type": "array", "items": {"type": "object", "required": ["name"]}},
        ),
        "InferenceResponse": obj(
            ["model_name", "outputs"],
            model_name=STRING,
            model_version=STRING,
            id=STRING,
            parameters={"type": "object"},
            outputs={"type": "array", "items": _TENSOR},
        ),
        "ServerMetadata": obj(
            ["name", "version", "extensions"],
            name=STRING,
            version=STRING,
            extensions={"type": "array", "items": STRING},
        ),
        "ModelMetadata": obj(
            ["name", "platform"],
            name=STRING,
            versions={"type": "array", "items": STRING},
            platform=STRING,
            inputs={"type": "array", "items": _META_TENSOR},
            outputs={"type": "array", "items": _META_TENSOR},
        ),
        "ModelConfig": {"type": "object", "required": ["name"]},
        "ModelStats": obj(
            ["model_stats"], model_stats={"type": "array", "items": {"type": "object"}}
        ),
    }
