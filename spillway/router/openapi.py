"""The router's public API as an OpenAPI 3.0 document, served at ``/openapi.json``.

Only what the router really answers is documented: every status listed for an operation
is one the router (or a backend it forwards) can return for it.
"""

from __future__ import annotations

import json
from typing import Any

from spillway import __version__
from spillway.policy.facts import MAX_BUDGET_MS, MIN_BUDGET_MS
from spillway.protocol.openapi import (
    BINARY,
    ERROR_CONTENT,
    HEADER_LENGTH_PARAMETER,
    STRING,
    obj,
    path_parameters,
    ref,
    schemas,
)
from spillway.router.openai_compat import openapi as openai_compat

_ROUTING_HEADERS = {
    "x-spillway-rule": "The policy rule that fired.",
    "x-spillway-backend": "The backend that answered (gpu, cpu, batch, or none).",
    "x-spillway-cost-usd": "Estimated cost of the request in US dollars.",
    "x-spillway-fallback": "<first backend>:<reason>, when a fallback backend answered.",
    "x-spillway-spilled": "true when the rule's spill share moved the request.",
    "x-spillway-model-version": "The model version that answered (the router chooses it "
    "for a request that pins none while the model runs a canary).",
}
_STATUS_TEXT = {
    400: "Invalid request, model name or version (or, for readiness, not ready).",
    404: "No such model or version.",
    413: "Request body over the size limit.",
    429: "The backend's queue is full; retry after Retry-After seconds.",
    500: "The backend failed to compute the request.",
    503: "No backend can serve now (down, circuit open, batch not configured).",
    504: "The deadline passed before a backend answered.",
}


def _headers(names: dict[str, str]) -> dict[str, Any]:
    return {k: {"description": v, "schema": {"type": "string"}} for k, v in names.items()}


def _errors(*statuses: int) -> dict[str, Any]:
    return {
        str(s): {
            "description": _STATUS_TEXT[s],
            "headers": _headers(_ROUTING_HEADERS),
            "content": ERROR_CONTENT,
        }
        for s in statuses
    }


def _hint_parameters() -> list[dict[str, Any]]:
    def header(name: str, schema: dict[str, Any], text: str) -> dict[str, Any]:
        return {"name": name, "in": "header", "schema": schema, "description": text}

    return [
        header(
            "x-spillway-mode",
            {"type": "string", "enum": ["auto", "realtime", "serverless", "batch"]},
            "Requested serving mode (a request parameter `mode` wins).",
        ),
        header(
            "x-spillway-latency-budget-ms",
            {"type": "number", "minimum": MIN_BUDGET_MS, "maximum": MAX_BUDGET_MS},
            "Latency budget in milliseconds; the request's deadline.",
        ),
        header(
            "x-spillway-priority",
            {"type": "integer", "minimum": 0, "maximum": 1000000},
            "Priority, 1 is the highest (Triton's convention).",
        ),
        header(
            "x-spillway-tenant",
            {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$"},
            "Calling tenant (an API Gateway authorizer's tenant wins).",
        ),
    ]


_IDEMPOTENCY_KEY = {
    "name": "Idempotency-Key",
    "in": "header",
    "schema": {"type": "string", "pattern": "^[!-~]{1,128}$"},
    "description": "Batch mode: the same caller sending the same body with the same key "
    "gets the job the first request started (without one, every request is a new job).",
}


_SESSION_ID = {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"}
_SESSION_HEADER = {
    "name": "x-spillway-session",
    "in": "header",
    "schema": _SESSION_ID,
    "description": "A session: for a model running a canary, every request of the session "
    "gets the version its first request got (x-spillway-model-version names it).",
}


def _sessions() -> dict[str, Any]:
    """``/v1/sessions/{id}``: a caller's small JSON state with a renewed TTL."""
    parameter = {"name": "id", "in": "path", "required": True, "schema": _SESSION_ID}
    state = {"application/json": {"schema": {"type": "object"}}}
    expires = {"x-spillway-session-expires-at": {"schema": {"type": "string"}}}
    errors = {
        "400": "Invalid session id or body (a JSON object without NaN or Infinity), "
        "or session state is not configured (ROUTER_STATE_TABLE).",
        "401": "No authenticated caller to scope the session to.",
        "404": "No live session of this caller under this id.",
        "413": "Session state over 65536 bytes.",
        "503": "The state table cannot be reached; retry after Retry-After.",
    }

    def answers(ok: str, text: str, *codes: str, body: bool = False) -> dict[str, Any]:
        first: dict[str, Any] = {"description": text, "headers": expires}
        if body:
            first["content"] = state
        failed = {c: {"description": errors[c], "content": ERROR_CONTENT} for c in codes}
        return {ok: first, **failed}

    return {
        "get": {
            "summary": "Read session state (renews its TTL)",
            "parameters": [parameter],
            "responses": answers("200", "The state", "400", "401", "404", "503", body=True),
        },
        "put": {
            "summary": "Store session state (a JSON object of at most 64 KiB)",
            "parameters": [parameter],
            "requestBody": {"required": True, "content": state},
            "responses": answers("204", "Stored", "400", "401", "413", "503"),
        },
        "delete": {
            "summary": "Delete session state",
            "parameters": [parameter],
            "responses": answers("204", "Deleted", "400", "401", "404", "503"),
        },
    }


def _ok(schema: str, description: str) -> dict[str, Any]:
    return {
        "description": description,
        "headers": _headers(_ROUTING_HEADERS),
        "content": {"application/json": {"schema": ref(schema)}},
    }


def _model_get(schema: str, summary: str, versioned: bool) -> dict[str, Any]:
    return {
        "get": {
            "summary": summary,
            "parameters": path_parameters(versioned) + _hint_parameters(),
            "responses": {"200": _ok(schema, summary), **_errors(400, 404, 503, 504)},
        }
    }


def _infer(versioned: bool) -> dict[str, Any]:
    ok = _ok("InferenceResponse", "Inference result (JSON, or binary with the extension).")
    ok["content"]["application/octet-stream"] = {"schema": BINARY}
    return {
        "post": {
            "summary": "Inference, routed by the policy",
            "parameters": [
                *path_parameters(versioned),
                *_hint_parameters(),
                HEADER_LENGTH_PARAMETER,
                _IDEMPOTENCY_KEY,
                _SESSION_HEADER,
            ],
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": ref("InferenceRequest")},
                    "application/octet-stream": {"schema": BINARY},
                },
            },
            "responses": {
                "200": ok,
                "202": _ok("BatchJob", "Accepted as an offline batch job."),
                **_errors(400, 404, 413, 429, 500, 503, 504),
            },
        }
    }


def _paths() -> dict[str, Any]:
    health = {"type": "object", "additionalProperties": {"type": "boolean"}}
    simple = {
        "/v2/health/live": ("Router liveness", health),
        "/v2/health/ready": ("Router readiness", health),
        "/v2": ("Server metadata", {"$ref": "#/components/schemas/ServerMetadata"}),
        "/openapi.json": ("This document", {"type": "object"}),
    }
    paths: dict[str, Any] = {}
    for path, (summary, schema) in simple.items():
        responses: dict[str, Any] = {
            "200": {"description": summary, "content": {"application/json": {"schema": schema}}}
        }
        if path == "/v2/health/ready":
            responses["400"] = {"description": "Not ready", "content": ERROR_CONTENT}
        paths[path] = {"get": {"summary": summary, "responses": responses}}
    stats = _model_get("ModelStats", "Statistics of every model", False)
    stats["get"]["parameters"] = _hint_parameters()
    # 400: a bad hint header; 404: a backend without the all-models statistics route.
    stats["get"]["responses"] = {
        "200": stats["get"]["responses"]["200"],
        **_errors(400, 404, 503, 504),
    }
    paths["/v2/models/stats"] = stats
    for versioned in (False, True):
        base = "/v2/models/{model}" + ("/versions/{version}" if versioned else "")
        paths[base] = _model_get("ModelMetadata", "Model metadata", versioned)
        paths[f"{base}/ready"] = _model_get("Ready", "Model readiness", versioned)
        paths[f"{base}/config"] = _model_get("ModelConfig", "Model configuration", versioned)
        paths[f"{base}/stats"] = _model_get("ModelStats", "Model statistics", versioned)
        paths[f"{base}/infer"] = _infer(versioned)
    paths["/v1/sessions/{id}"] = _sessions()
    paths.update(openai_compat.paths())
    return paths


_ROUTING = {
    "type": "object",
    "description": "Open parameters; the router reads mode, latency_budget_ms, priority and "
    "tenant, and sets timeout (microseconds) for the backend.",
    "properties": {
        "mode": {"type": "string", "enum": ["auto", "realtime", "serverless", "batch"]},
        "latency_budget_ms": {"type": "number", "minimum": MIN_BUDGET_MS, "maximum": MAX_BUDGET_MS},
        "priority": {"type": "integer", "minimum": 0},
        "tenant": {"type": "string"},
    },
}


_SCHEMAS: dict[str, Any] = {
    **schemas(_ROUTING),
    "BatchJob": obj(["job_id", "status"], job_id=STRING, status=STRING, status_url=STRING),
    "Ready": obj([], ready={"type": "boolean"}),
    **openai_compat.schemas(),
}


def document() -> dict[str, Any]:
    """The OpenAPI document of the router's public API."""
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "Spillway router",
            "version": __version__,
            "description": "Open Inference Protocol (KServe V2) with Triton's binary tensor "
            "extension, routed by policy over the GPU service, the CPU fallback and batch; "
            "OpenAI-compatible embeddings over the same routing.",
        },
        "paths": _paths(),
        "components": {"schemas": _SCHEMAS},
    }


def document_bytes() -> bytes:
    """The document serialised once, as served."""
    return json.dumps(document(), separators=(",", ":")).encode()
