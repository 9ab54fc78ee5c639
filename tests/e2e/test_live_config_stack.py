"""``spillway tenants`` on the local stack: a tenant added or removed reaches every door
within the doors' config TTL (2 s locally), with no restart and no deploy.

Two API keys: ``live-key-b`` starts as its own tenant; ``spillway tenants add`` maps it to
``live-acme``, and ``remove`` maps it back. Each door shows which tenant it took the
caller for:

- the jobs API: a job whose input lies in ``live-acme``'s area is 403
  ``outside_tenant_area`` for any other tenant, and passes the area check for it;
- the WebSocket API: a connection's ``stats`` frame names the connection's tenant, as
  ``$connect`` resolved it;
- the router (its Lambda handler behind an API Gateway-shaped server, with the stack's
  router environment: the API key's id is the identity): a session stored by one tenant
  is a 404 for another.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import serverless_wsgi

from spillway.router.settings import RouterSettings
from spillway.router.wiring import create_app
from spillway.state.table import scope
from spillway_cli.local.lambda_http import wsgi_app
from spillway_cli.local.names import TENANTS_ROOT
from spillway_cli.local.stack import LocalStack
from spillway_cli.local.wsgi_server import running

KEY = "live-key-b"
TENANT = "live-acme"
SPILLWAY = Path(sys.executable).with_name("spillway")


def _run(stack: LocalStack, *args: str) -> subprocess.CompletedProcess[str]:
    """``spillway`` as a user runs it beside a running stack (its stack env file)."""
    return subprocess.run(
        [str(SPILLWAY), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"PATH": str(SPILLWAY.parent), "SPILLWAY_STACK_ENV": str(stack.stack_env_path)},
    )


def _cli(stack: LocalStack, *args: str) -> str:
    done = _run(stack, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _until(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Wait for ``check`` (the TTL is 2 s; generous for a loaded machine)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.25)


def _request(
    port: int, method: str, path: str, headers: dict[str, str], body: object = None
) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        raw = json.dumps(body).encode() if body is not None else None
        conn.request(
            method, path, body=raw, headers={"content-type": "application/json", **headers}
        )
        answer = conn.getresponse()
        text = answer.read()
        return answer.status, json.loads(text) if text else {}
    finally:
        conn.close()


def _jobs_code(stack: LocalStack) -> str:
    """What the jobs API says to ``KEY`` for a job in ``TENANT``'s area."""
    area = f"{TENANTS_ROOT}/{scope(TENANT)}"
    job = {"model": "no-such-model", "input": f"{area}/in/", "output": f"{area}/out/"}
    status, answer = _request(stack.ports.jobs, "POST", "/v1/jobs", {"x-api-key": KEY}, job)
    assert 400 <= status < 500, answer
    return str(answer.get("code"))


def _ws_tenant(stack: LocalStack) -> str:
    """The tenant the WebSocket API's ``$connect`` took ``KEY``'s connection for."""

    async def ask() -> str:
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(stack.websocket_url, headers={"x-api-key": KEY}) as ws,
        ):
            await ws.send_str(json.dumps({"id": "who", "action": "stats"}))
            answer = json.loads(await asyncio.wait_for(ws.receive_str(), 60))
            return str(answer["connection"]["tenant"])

    return asyncio.run(ask())


@pytest.fixture(scope="module")
def router_port(stack: LocalStack) -> Iterator[int]:
    """The router's Lambda handler as API Gateway calls it (``x-api-key`` standing for the
    key's id), with the stack's router environment; its port."""
    mp = pytest.MonkeyPatch()
    for name, value in {**stack.aws_env(), **stack.router_env()}.items():
        mp.setenv(name, value)
    mp.delenv("ROUTER_IDENTITY_TENANTS", raising=False)
    app = create_app(RouterSettings.from_env())

    def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
        answer: dict[str, Any] = serverless_wsgi.handle_request(app, event, context)
        return answer

    try:
        with running(wsgi_app(handler)) as url:
            yield int(url.rsplit(":", 1)[1])
    finally:
        mp.undo()


def _session_status(port: int) -> int:
    status, _ = _request(port, "GET", "/v1/sessions/live-config", {"x-api-key": KEY})
    return status


@pytest.fixture
def mapped(stack: LocalStack) -> Iterator[None]:
    """The identity this test maps is removed again (the stack is shared)."""
    yield
    if KEY in json.loads(_cli(stack, "tenants", "list", "--json"))["identities"]:
        _cli(stack, "tenants", "remove", KEY)


def test_a_tenant_changed_with_the_cli_reaches_every_door(
    stack: LocalStack, router_port: int, mapped: None
) -> None:
    # GIVEN a key no one mapped: its own tenant at every door
    assert _jobs_code(stack) == "outside_tenant_area"
    assert _ws_tenant(stack) == KEY
    stored, _ = _request(
        router_port, "PUT", "/v1/sessions/live-config", {"x-api-key": KEY}, {"step": 1}
    )
    assert stored in (200, 201, 204)
    assert _session_status(router_port) == 200

    # WHEN an operator maps it to live-acme
    out = _cli(stack, "tenants", "add", KEY, TENANT)
    assert f"{KEY} -> {TENANT}" in out
    assert json.loads(_cli(stack, "tenants", "list", "--json"))["identities"][KEY] == TENANT

    # THEN each door takes the caller for live-acme within the TTL, with no restart
    _until(lambda: _jobs_code(stack) != "outside_tenant_area", "the jobs API sees the tenant")
    _until(lambda: _ws_tenant(stack) == TENANT, "the WebSocket API sees the tenant")
    _until(lambda: _session_status(router_port) == 404, "the router sees the tenant")

    # AND removing it puts every door back
    _cli(stack, "tenants", "remove", KEY)
    _until(lambda: _jobs_code(stack) == "outside_tenant_area", "the jobs API forgets it")
    _until(lambda: _ws_tenant(stack) == KEY, "the WebSocket API forgets it")
    _until(lambda: _session_status(router_port) == 200, "the router forgets it")


def test_the_cli_refuses_a_bad_tenant_with_one_line(stack: LocalStack) -> None:
    done = _run(stack, "tenants", "add", KEY, "not a tenant")
    assert done.returncode == 1
    assert done.stderr.strip() == "error: tenant must be 1-128 letters, digits or ._:@-"
    assert "Traceback" not in done.stderr
