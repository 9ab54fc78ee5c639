"""The GPU service's API as an OpenAPI 3.0 document, served at ``/openapi.json``.

Every status listed for an operation is one the service can return for it.
"""

from __future__ import annotations

import json
from typing import Any

from spillway import __version__
from spillway.protocol.openapi import (
    BINARY,
    ERROR_CONTENT,
    HEADER_LENGTH_PARAMETER,
    obj,
    path_parameters,
    ref,
    schemas,
)

_TEXT = {
    400: "Invalid request, model name or version (for readiness: not ready).",
    401: "The admin token is missing or wrong.",
    404: "No such model, version or path.",
    405: "Method not allowed on this path.",
    413: "Request body over the size limit.",
    429: "The model's queue is full; retry after Retry-After seconds.",
    500: "The model failed to load or to compute.",
    503: "The model is not ready (loading, evicted, over budget) or the service is draining.",
    504: "The request's deadline passed in the queue.",
}
_LOAD_HEADERS = {
    name: {"description": text, "schema": {"type": "string"}}
    for name, text in {
        "x-spillway-model-version": "The version that computed the response.",
        "x-spillway-queue-depth": "Requests waiting in that version's queue.",
        "x-spillway-busy": "Share of the last 10 s the version spent computing.",
    }.items()
}
_PARAMETERS = {
    "type": "object",
    "description": "Open parameters; the service reads priority (1 is highest) and timeout "
    "(microseconds), and binary_data_output.",
    "properties": {
        "priority": {"type": "integer", "minimum": 0},
        "timeout": {"type": "integer", "minimum": 0},
        "binary_data_output": {"type": "boolean"},
    },
}


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(s): {"description": _TEXT[s], "content": ERROR_CONTENT} for s in statuses}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _empty(description: str) -> dict[str, Any]:
    return {"description": description}


def _model_paths(versioned: bool) -> dict[str, Any]:
    base = "/v2/models/{model}" + ("/versions/{version}" if versioned else "")
    params = path_parameters(versioned)

    def get(ok: dict[str, Any], *errors: int) -> dict[str, Any]:
        return {"get": {"parameters": params, "responses": {"200": ok, **_errors(*errors)}}}

    ok = _json(ref("InferenceResponse"), "Inference result (JSON, or binary).")
    ok["headers"] = _LOAD_HEADERS
    ok["content"]["application/octet-stream"] = {"schema": BINARY}
    infer = {
        "post": {
            "parameters": [*params, HEADER_LENGTH_PARAMETER],
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": ref("InferenceRequest")},
                    "application/octet-stream": {"schema": BINARY},
                },
            },
            "responses": {"200": ok, **_errors(400, 404, 413, 429, 500, 503, 504)},
        }
    }
    return {
        base: get(_json(ref("ModelMetadata"), "Model metadata"), 400, 404, 503),
        f"{base}/ready": get(_empty("Ready"), 400, 404),
        f"{base}/config": get(_json(ref("ModelConfig"), "Model configuration"), 400, 404, 503),
        f"{base}/stats": get(_json(ref("ModelStats"), "Model statistics"), 400, 404, 503),
        f"{base}/infer": infer,
    }


def _paths() -> dict[str, Any]:
    paths: dict[str, Any] = {
        "/v2/health/live": {"get": {"responses": {"200": _empty("Live")}}},
        "/v2/health/ready": {"get": {"responses": {"200": _empty("Ready"), **_errors(400)}}},
        "/v2": {"get": {"responses": {"200": _json(ref("ServerMetadata"), "Metadata")}}},
        "/v2/models/stats": {
            "get": {
                "responses": {"200": _json(ref("ModelStats"), "Statistics of every loaded version")}
            }
        },
        "/metrics": {
            "get": {
                "responses": {
                    "200": {
                        "description": "Prometheus text exposition",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                }
            }
        },
        "/openapi.json": {
            "get": {"responses": {"200": _json({"type": "object"}, "This document")}}
        },
        "/v2/repository/index": {
            "post": {
                "responses": {
                    "200": _json(
                        {
                            "type": "array",
                            "items": obj(
                                ["name", "version", "state", "reason"],
                                name={"type": "string"},
                                version={"type": "string"},
                                state={"type": "string"},
                                reason={"type": "string"},
                            ),
                        },
                        "Every model and version with its state",
                    ),
                    **_errors(401),
                }
            }
        },
    }
    for op in ("load", "unload"):
        paths[f"/v2/repository/models/{{model}}/{op}"] = {
            "post": {
                "parameters": path_parameters(False),
                "responses": {"200": _empty(f"{op.title()}ed"), **_errors(400, 401, 404, 500, 503)},
            }
        }
    for versioned in (False, True):
        paths.update(_model_paths(versioned))
    return paths


def document() -> dict[str, Any]:
    """The OpenAPI document of the GPU service."""
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "Spillway GPU service",
            "version": __version__,
            "description": "Open Inference Protocol (KServe V2) with Triton's binary "
            "tensor, statistics, configuration and repository extensions.",
        },
        "paths": _paths(),
        "components": {"schemas": schemas(_PARAMETERS)},
    }


def document_bytes() -> bytes:
    """The document serialised once, as served."""
    return json.dumps(document(), separators=(",", ":")).encode()
