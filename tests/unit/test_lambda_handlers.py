"""The four Lambda handlers in Powertools' shape, each in a fresh interpreter (a cold
start of its own): the adapter's answer, one log line per event with the Lambda context
and API Gateway's request id as correlation id, the cold-start metric as one valid EMF
line, and a warm invocation without metrics that neither fails nor writes one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
EVENTS = ROOT / "events"

# Two invocations in one execution environment; stdout is the function's log (as on
# Lambda), the answers go to the file named first.
_RUNNER = """
import importlib, json, sys
from tests.lambda_context import LambdaContext
module = importlib.import_module(sys.argv[2])
with open(sys.argv[3]) as file:
    event = json.load(file)
answers = [module.handler(event, LambdaContext()) for _ in range(2)]
with open(sys.argv[1], "w") as out:
    json.dump({"answers": answers, "traced": module.settings.tracing}, out)
"""


def _event(path: str, **changes: Any) -> dict[str, Any]:
    event: dict[str, Any] = json.loads((EVENTS / path).read_text())
    event.update(changes)
    return event


def _anonymous_status() -> dict[str, Any]:
    # nothing vouches for the caller: 401 before any AWS call
    event = _event("jobs/status.json")
    event["requestContext"]["identity"]["apiKeyId"] = None
    return event


CASES = {
    # name: (module, event, environment, status, metrics service)
    "router": (
        "functions.router.handler",
        _event("router/live-rest-v1.json"),
        {"ROUTER_GPU_URL": "", "ROUTER_METRICS_LOG": os.devnull},
        200,
        "spillway-router",
    ),
    "jobs": ("functions.jobs.handler", _anonymous_status(), {}, 401, "spillway-jobs"),
    "cpu": (
        "functions.cpu_infer.handler",
        # a model the (empty) repository does not have: the direct-invoke path's 404
        _event("cpu_infer/metadata-direct.json"),
        {"CPU_REPOSITORY": "{empty}", "CPU_MODELS": "[]", "CPU_CACHE_DIR": "{empty}"},
        404,
        "spillway-cpu-infer",
    ),
    "websocket": (
        "functions.websocket.handler",
        # a $connect to a deployment without a state table: refused before any AWS call
        _event("websocket/connect.json"),
        {"ROUTER_GPU_URL": "", "ROUTER_METRICS_LOG": os.devnull},
        503,
        "spillway-websocket",
    ),
}


def check_emf(document: dict[str, Any]) -> None:
    """Fail unless ``document`` is a valid CloudWatch Embedded Metric Format document."""
    meta = document["_aws"]
    assert isinstance(meta["Timestamp"], int)
    for directive in meta["CloudWatchMetrics"]:
        assert isinstance(directive["Namespace"], str)
        assert directive["Namespace"]
        for dimension_set in directive["Dimensions"]:
            assert all(isinstance(document[name], str) for name in dimension_set)
        for metric in directive["Metrics"]:
            assert isinstance(document[metric["Name"]], (int, float, list))


def run_handler(name: str, tmp_path: Path) -> tuple[dict[str, Any], list[dict[str, Any]], str]:
    """The handler's two answers, the JSON lines it wrote to stdout and its stderr."""
    module, event, variables, _, _ = CASES[name]
    empty = tmp_path / "empty"
    empty.mkdir()
    event_file, out = tmp_path / "event.json", tmp_path / "answers.json"
    event_file.write_text(json.dumps(event))
    env = {
        **os.environ,
        "AWS_DEFAULT_REGION": "us-east-1",
        **{k: v.replace("{empty}", str(empty)) for k, v in variables.items()},
    }
    unsets = ("POWERTOOLS_METRICS_NAMESPACE", "POWERTOOLS_DEV", "ROUTER_POLICY_PARAMETER")
    for unset in (*unsets, "ROUTER_STATE_TABLE", "WS_TRACING"):
        env.pop(unset, None)
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(out), module, str(event_file)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(out.read_text()), lines, done.stderr


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_cold_then_a_warm_invocation(name: str, tmp_path: Path) -> None:
    # GIVEN the function's handler module in a fresh interpreter, tracing off
    # WHEN it serves one event twice
    result, lines, stderr = run_handler(name, tmp_path)
    # THEN both invocations get the adapter's answer, and no tracer wraps the handler
    status = CASES[name][3]
    assert [a["statusCode"] for a in result["answers"]] == [status, status]
    assert result["traced"] is False
    # AND exactly one EMF line, the cold start's, valid, in the Spillway namespace with
    # the function's service (the warm invocation added no metric and flushed nothing)
    emf = [line for line in lines if "_aws" in line]
    assert len(emf) == 1, lines
    (cold,) = emf
    check_emf(cold)
    (directive,) = cold["_aws"]["CloudWatchMetrics"]
    assert directive["Namespace"] == "Spillway"
    assert directive["Metrics"] == [{"Name": "ColdStart", "Unit": "Count"}]
    assert cold["ColdStart"] == [1.0]
    assert cold["function_name"] == "spillway-router"  # tests.lambda_context's name
    assert cold["service"] == CASES[name][4]
    # AND an empty flush is at most a warning
    assert "Traceback" not in stderr


def test_log_lines_carry_the_context_and_the_request_id(tmp_path: Path) -> None:
    # GIVEN an API Gateway event the jobs API refuses WHEN the handler serves it
    _, lines, _ = run_handler("jobs", tmp_path)
    # THEN its "refused" lines carry the Lambda context and API Gateway's request id
    refused = [line for line in lines if line.get("message") == "refused"]
    assert len(refused) == 2, lines
    for line in refused:
        assert line["correlation_id"] == CASES["jobs"][1]["requestContext"]["requestId"]
        assert line["function_request_id"] == "6f1c0cd2-5b5a-4b59-9d44-6a6e6f1b8c1e"
        assert (line["status"], line["code"]) == (401, "unauthenticated")


def test_websocket_log_lines_carry_the_request_id(tmp_path: Path) -> None:
    # GIVEN a $connect the WebSocket function refuses WHEN the handler serves it
    _, lines, _ = run_handler("websocket", tmp_path)
    # THEN its "refused" lines carry API Gateway's request id and the stable code
    refused = [line for line in lines if line.get("message") == "refused"]
    assert len(refused) == 2, lines
    for line in refused:
        assert line["correlation_id"] == CASES["websocket"][1]["requestContext"]["requestId"]
        assert line["connection_id"] == CASES["websocket"][1]["requestContext"]["connectionId"]
        assert (line["status"], line["code"]) == (503, "websocket_not_configured")
