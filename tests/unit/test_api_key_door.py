"""The WSGI router runtime checks API keys as API Gateway's REST API (and the other
runtime, serverless-offline) does: no key or a wrong one is 403 ``{"message":"Forbidden"}``
before the router sees the request; the local key reaches it as API Gateway's event
names it, so the router's caller is the key's tenant (``spillway tenants``)."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

from spillway.tenancy.identity import vouched_tenant
from spillway_cli.local.lambda_http import api_key_door
from spillway_cli.local.names import LOCAL_API_KEY
from spillway_cli.local.stack import LocalStack

TENANTS = {LOCAL_API_KEY: "acme"}


def _call(app: Any, headers: dict[str, str]) -> tuple[str, dict[str, str], bytes]:
    environ: dict[str, Any] = {
        "REQUEST_METHOD": "GET",
        "PATH_INFO": "/v2",
        "REMOTE_ADDR": "127.0.0.1",
        "wsgi.input": io.BytesIO(b""),
        **{f"HTTP_{k.upper().replace('-', '_')}": v for k, v in headers.items()},
    }
    answer: dict[str, Any] = {}

    def start_response(status: str, response_headers: list[tuple[str, str]]) -> None:
        answer.update(status=status, headers=dict(response_headers))

    body = b"".join(app(environ, start_response))
    return answer["status"], answer["headers"], body


class _Router:
    """Stands for the router: answers the tenant it would take the caller for."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        self.calls += 1
        tenant = vouched_tenant(
            environ.get("serverless.authorizer"), environ.get("serverless.event"), TENANTS
        )
        start_response("200 OK", [("Content-Type", "application/json")])
        return [json.dumps({"tenant": tenant}).encode()]


@pytest.mark.parametrize("headers", [{}, {"x-api-key": "wrong-key"}, {"x-api-key": ""}])
def test_a_request_without_the_key_is_refused_before_the_router(headers: dict[str, str]) -> None:
    # GIVEN the router behind the door WHEN a request comes without the local key
    router = _Router()
    status, sent, body = _call(api_key_door(router, [LOCAL_API_KEY]), headers)
    # THEN API Gateway's refusal, and the router never saw it
    assert status == "403 Forbidden"
    assert json.loads(body) == {"message": "Forbidden"}
    assert sent["x-amzn-ErrorType"] == "ForbiddenException"
    assert router.calls == 0


def test_the_local_key_reaches_the_router_as_its_tenant() -> None:
    # GIVEN the router behind the door, the local key mapped to a tenant
    router = _Router()
    # WHEN a request carries the key, and claims another identity in a header
    status, _, body = _call(
        api_key_door(router, [LOCAL_API_KEY]),
        {"x-api-key": LOCAL_API_KEY, "x-spillway-tenant": "globex"},
    )
    # THEN the router takes the caller for the key's tenant
    assert status == "200 OK"
    assert json.loads(body) == {"tenant": "acme"}


def test_the_stack_puts_its_wsgi_router_behind_the_door(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN a stack that checks API keys, its router's start recorded (not run)
    local = LocalStack(tmp_path / "m", tmp_path / "l", check_api_keys=True)
    started: list[tuple[list[str], dict[str, str] | None]] = []

    def record(name: str, argv: list[str], env: Any, health: str, headers: Any = None) -> None:
        started.append((argv, headers))

    monkeypatch.setattr(local, "_start", record)
    # WHEN the WSGI router starts
    local._router_wsgi()
    # THEN it is told the key, its health is asked with it, and so are the lines printed
    argv, headers = started[0]
    assert argv[argv.index("--api-key") + 1] == LOCAL_API_KEY
    assert headers == {"x-api-key": LOCAL_API_KEY}
    assert f"-H 'x-api-key: {LOCAL_API_KEY}'" in local.summary()
    assert local.stack_env()["SPILLWAY_API_KEY"] == LOCAL_API_KEY
