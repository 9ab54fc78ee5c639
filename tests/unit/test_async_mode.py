"""Async mode's parts that need no AWS: how a request asks for it, what a deployment
without it answers, and how the GPU consumer lowers a request's priority."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from werkzeug.test import Client

from functions.router.facts import read_hints
from functions.router.settings import RouterSettings
from functions.router.wiring import Overrides, create_app
from gpu_service.async_consumer import as_background
from spillway.wire import read_json_header

BODY = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}


@pytest.mark.parametrize(
    ("parameters", "headers", "mode"),
    [
        ({"mode": "async"}, {}, "async"),
        ({}, {"x-spillway-mode": "async"}, "async"),
        ({}, {"prefer": "respond-async, wait=10"}, "async"),
        ({"mode": "realtime"}, {"prefer": "respond-async"}, "realtime"),
        ({}, {}, None),
    ],
)
def test_how_a_request_asks_for_async(
    parameters: dict[str, str], headers: dict[str, str], mode: str | None
) -> None:
    assert read_hints(parameters, headers).mode == mode


def test_a_deployment_without_async_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TABLE", "QUEUE_URL", "LOCATION"):
        monkeypatch.delenv(f"ASYNC_{name}", raising=False)
    settings = RouterSettings(gpu_url=None, metrics_log=Path("/dev/null"))
    client = Client(create_app(settings, Overrides(backends={})))
    answer = client.post("/v2/models/digits/infer", json=BODY, headers={"prefer": "respond-async"})
    assert answer.status_code == 400
    assert json.loads(answer.data)["code"] == "mode_unavailable"
    assert client.get("/v1/results/" + "0" * 32).status_code == 404


@pytest.mark.parametrize("binary", [False, True])
def test_background_work_runs_at_the_lowest_priority(binary: bool) -> None:
    header = json.dumps({**BODY, "parameters": {"priority": 1, "timeout": 5}}).encode()
    tensor = b"\x00\x00\x80\x3f"
    body, length = (header + tensor, len(header)) if binary else (header, None)
    lowered, new_length = as_background(body, length, 3)
    parsed = read_json_header(lowered, new_length)
    assert parsed["parameters"] == {"priority": 3, "timeout": 5}
    assert parsed["inputs"] == BODY["inputs"]
    if binary:
        assert new_length is not None
        assert lowered[new_length:] == tensor
    else:
        assert new_length is None
