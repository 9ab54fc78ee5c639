"""The CPU fallback over HTTP: a WSGI application (``spillway serve cpu``, API Gateway).

It serves the Open Inference Protocol paths the fallback supports, and, for local stacks,
Lambda's invoke API (``POST /2015-03-31/functions/{name}/invocations``) answered with the
direct-invoke handler, so the router's ``lambda:Invoke`` path runs end to end on
127.0.0.1 exactly as against ``sam local start-lambda``. Errors are mapped here once.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable
from http import HTTPStatus
from typing import Any

from functions.cpu_infer.direct import handle_direct
from functions.cpu_infer.service import CpuService
from spillway.codec import header_length_from
from spillway.errors import (
    InvalidInputError,
    MethodNotAllowedError,
    PayloadTooLargeError,
    RouteNotFoundError,
    SpillwayError,
)

log = logging.getLogger("spillway.cpu_infer")

StartResponse = Callable[[str, list[tuple[str, str]]], Any]
Reply = tuple[int, list[tuple[str, str]], bytes]
_MODEL_PATH = re.compile(
    r"^/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?"
    r"(?:/(?P<op>ready|config|infer))?$"
)
_INVOKE_PATH = re.compile(r"^/2015-03-31/functions/(?P<name>[^/]+)/invocations$")
_JSON = ("content-type", "application/json")


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


class CpuApp:
    """WSGI entry point of the CPU fallback."""

    def __init__(self, service: CpuService) -> None:
        self.service = service

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        method, path = environ.get("REQUEST_METHOD", "GET"), _path(environ)
        try:
            status, headers, body = self._route(method, path, environ)
        except SpillwayError as error:
            status, headers, body = error.status, [_JSON], _json(error.to_body())
            log.info("%s %s -> %d %s: %s", method, path, status, error.code, error.message)
        except Exception:
            log.exception("unhandled error on %s %s", method, path)
            status, headers = 500, [_JSON]
            body = _json({"error": "internal error", "code": "internal"})
        headers = [*headers, ("content-length", str(len(body)))]
        start_response(f"{status} {HTTPStatus(status).phrase}", headers)
        return [body]

    def _route(self, method: str, path: str, environ: dict[str, Any]) -> Reply:
        if match := _MODEL_PATH.match(path):
            return self._model(method, match, environ)
        if match := _INVOKE_PATH.match(path):
            _allow(method, path, "POST")
            return self._invoke(match["name"], self._body(environ))
        _allow(method, path, "GET")
        if path == "/v2/health/live":
            return 200, [_JSON], _json({"live": True})
        if path == "/v2/health/ready":
            return 200, [_JSON], _json({"ready": True})
        if path == "/v2":
            return 200, [_JSON], _json(self.service.server_metadata())
        raise RouteNotFoundError(f"no route for {path[:200]}")

    def _model(self, method: str, match: re.Match[str], environ: dict[str, Any]) -> Reply:
        model, version, op = match["model"], match["version"], match["op"]
        if op == "infer":
            _allow(method, match.string, "POST")
            length = header_length_from(environ.get("HTTP_INFERENCE_HEADER_CONTENT_LENGTH"))
            answer = self.service.infer(model, version, self._body(environ), length)
            headers = [("x-spillway-model-version", str(answer.version))]
            if answer.header_length is None:
                headers.append(_JSON)
            else:
                headers += [
                    ("content-type", "application/octet-stream"),
                    ("inference-header-content-length", str(answer.header_length)),
                ]
            return 200, headers, answer.body
        _allow(method, match.string, "GET")
        if op == "ready":
            self.service.get(model, version)
            return 200, [_JSON], _json({"ready": True})
        if op == "config":
            return 200, [_JSON], _json(self.service.config(model, version))
        return 200, [_JSON], _json(self.service.metadata(model, version))

    def _invoke(self, name: str, body: bytes) -> Reply:
        if name != self.service.settings.function_name:
            headers = [_JSON, ("x-amzn-errortype", "ResourceNotFoundException")]
            return 404, headers, _json({"Type": "User", "message": f"Function not found: {name}"})
        try:
            event = json.loads(body)
        except ValueError:
            raise InvalidInputError("the invocation payload is not JSON") from None
        if not isinstance(event, dict):
            raise InvalidInputError("the invocation payload must be a JSON object")
        return 200, [_JSON], _json(handle_direct(self.service, event))

    def _body(self, environ: dict[str, Any]) -> bytes:
        # The invoke API carries base64 of the body, so allow for its growth by 4/3.
        limit = self.service.settings.max_payload_bytes * 4 // 3 + 4096
        declared = environ.get("CONTENT_LENGTH") or ""
        if not declared.isdigit():
            return b""
        if int(declared) > limit:
            raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
        return bytes(environ["wsgi.input"].read(int(declared)))


def _allow(method: str, path: str, allowed: str) -> None:
    if method != allowed:
        raise MethodNotAllowedError(f"{method[:16]} is not allowed on {path[:200]}")


def _path(environ: dict[str, Any]) -> str:
    path = environ.get("PATH_INFO") or "/"
    event = environ.get("serverless.event")
    if isinstance(event, dict) and event.get("version") == "2.0":
        # An HTTP API with a named stage keeps the stage in rawPath; REST APIs do not.
        stage = (event.get("requestContext") or {}).get("stage")
        if stage and stage != "$default" and path.startswith(f"/{stage}/"):
            path = path[len(stage) + 1 :]
    return str(path)
