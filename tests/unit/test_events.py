"""events/ holds what API Gateway and EventBridge really send for template.yaml's routes.

GIVEN every event file THEN a REST API (v1) event has the shape SAM's ``generate-event
apigateway aws-proxy`` gives, names a route of the template with an allowed method, and is
consistent with itself (path and path parameters, stage path, headers, a base64 body, as
the API's ``*/*`` binary media types make API Gateway send every body); an HTTP API (v2)
event is consistent the same way; the scheduled event is EventBridge's. AND every API route
of the template has a REST event.
"""

from __future__ import annotations

import base64
import json
import re
import uuid
from pathlib import Path
from typing import Any

import pytest

from batch_job.service import JOB_ID_NAMESPACE
from spillway.state.table import scope
from spillway.tenancy.areas import area
from spillway.tenancy.identity import authenticated_identity
from spillway_cli.local.sam_env import FUNCTION_TYPE, load_template

ROOT = Path(__file__).resolve().parents[2]
EVENTS = ROOT / "events"
FOLDERS = {"router": "RouterFunction", "cpu_infer": "CpuInferFunction", "jobs": "JobsFunction"}
REST_KEYS = {
    "body", "resource", "path", "httpMethod", "isBase64Encoded", "queryStringParameters",
    "multiValueQueryStringParameters", "pathParameters", "stageVariables", "headers",
    "multiValueHeaders", "requestContext",
}  # fmt: skip
REST_CONTEXT_KEYS = {
    "accountId", "resourceId", "stage", "requestId", "requestTime", "requestTimeEpoch",
    "identity", "path", "resourcePath", "httpMethod", "apiId", "protocol",
}  # fmt: skip


def _events() -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{path.parent.name}/{path.name}", json.loads(path.read_text()))
        for path in sorted(EVENTS.glob("*/*.json"))
    ]


EVENT_FILES = _events()
REST = [(n, e) for n, e in EVENT_FILES if "httpMethod" in e]
HTTP = [(n, e) for n, e in EVENT_FILES if e.get("version") == "2.0"]


def api_routes() -> dict[str, set[tuple[str, str]]]:
    """(path, method) of each function's API events in template.yaml."""
    routes: dict[str, set[tuple[str, str]]] = {}
    for name, resource in load_template()["Resources"].items():
        if resource.get("Type") != FUNCTION_TYPE:
            continue
        events = (resource["Properties"].get("Events") or {}).values()
        routes[name] = {
            (e["Properties"]["Path"], e["Properties"]["Method"].upper())
            for e in events
            if e["Type"] == "Api"
        }
    return routes


def _match(route: str, path: str) -> dict[str, str] | None:
    """The path parameters of ``path`` under an API Gateway route, or None."""
    pattern = re.sub(r"\\\{(\w+)\\\+\\\}", r"(?P<\1>.+)", re.escape(route))
    pattern = re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", pattern)
    found = re.fullmatch(pattern, path)
    return None if found is None else found.groupdict()


def _body(event: dict[str, Any]) -> bytes:
    raw = event["body"]
    return base64.b64decode(raw, validate=True) if event["isBase64Encoded"] else raw.encode()


@pytest.mark.parametrize(("name", "event"), REST, ids=[n for n, _ in REST])
def test_rest_event_is_what_api_gateway_sends_for_a_route(name: str, event: dict[str, Any]) -> None:
    assert set(event) >= REST_KEYS
    context = event["requestContext"]
    assert set(context) >= REST_CONTEXT_KEYS
    # a route of the template (the function's own, or the API's for one it serves behind it)
    routes = api_routes()
    own = routes[FOLDERS[name.split("/")[0]]] or set().union(*routes.values())
    method = event["httpMethod"]
    assert (event["resource"], method) in own or (event["resource"], "ANY") in own
    # consistent with itself
    assert event["pathParameters"] == (_match(event["resource"], event["path"]) or None)
    assert (context["resourcePath"], context["httpMethod"]) == (event["resource"], method)
    assert context["path"] == f"/{context['stage']}{event['path']}"
    assert event["multiValueHeaders"] == {k: [v] for k, v in event["headers"].items()}
    if method == "GET":
        assert (event["body"], event["isBase64Encoded"]) == (None, False)
    else:
        assert event["isBase64Encoded"], "*/* binary media types: API Gateway sends base64"
        assert "Content-Type" in event["headers"]
        assert _body(event)


@pytest.mark.parametrize(("name", "event"), HTTP, ids=[n for n, _ in HTTP])
def test_http_api_event_is_consistent(name: str, event: dict[str, Any]) -> None:
    http = event["requestContext"]["http"]
    assert (http["path"], event["routeKey"]) == (event["rawPath"], "$default")
    stage = event["requestContext"]["stage"]
    path = event["rawPath"].removeprefix(f"/{stage}") if stage != "$default" else event["rawPath"]
    routes = set().union(*api_routes().values())
    assert any(_match(route, path) is not None for route, _ in routes), path
    if http["method"] != "GET":
        assert _body(event)


def test_every_api_route_has_a_rest_event() -> None:
    covered = {(e["resource"], e["httpMethod"]) for _, e in REST}
    for function, routes in api_routes().items():
        for path, method in routes:
            assert any(r == path and (method == "ANY" or m == method) for r, m in covered), (
                f"{function}: no REST event for {method} {path}"
            )


def test_the_scheduled_event_is_eventbridges() -> None:
    event = json.loads((EVENTS / "jobs" / "nightly.json").read_text())
    assert (event["source"], event["detail-type"]) == ("aws.events", "Scheduled Event")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", event["time"])


@pytest.mark.parametrize(
    ("name", "event"),
    [(n, e) for n, e in REST + HTTP if "/infer" in (e.get("path") or e.get("rawPath", ""))],
)
def test_infer_bodies_are_open_inference_requests(name: str, event: dict[str, Any]) -> None:
    body = _body(event)
    headers = {k.lower(): v for k, v in event["headers"].items()}
    size = int(headers.get("inference-header-content-length", len(body)))
    request = json.loads(body[:size])
    assert request["inputs"], name


def test_the_jobs_events_are_one_callers_within_its_area() -> None:
    # GIVEN the jobs API's REST events: one caller, identified as API Gateway identifies
    # it (an API key id; unmapped, its own tenant)
    events = {name: json.loads((EVENTS / "jobs" / f"{name}.json").read_text())
              for name in ("submit", "status", "status-of-submit")}  # fmt: skip
    callers = {authenticated_identity(e) for e in events.values()}
    assert len(callers) == 1
    assert None not in callers
    (tenant,) = callers
    # THEN what submit.json names lies in that tenant's area of the job data bucket
    request = json.loads(_body(events["submit"]))
    own = area("s3://spillway-data/tenants", tenant)
    assert request["input"].startswith(own)
    assert request["output"].startswith(own)
    # AND status-of-submit.json asks for the job submit.json's key makes for that tenant
    key = {k.lower(): v for k, v in events["submit"]["headers"].items()}["idempotency-key"]
    job = str(uuid.uuid5(JOB_ID_NAMESPACE, f"{scope(tenant)}\0{key}"))
    assert events["status-of-submit"]["pathParameters"]["id"] == job
