"""The WebSocket API's AWS resources in both template forms, evaluated offline.

GIVEN template.yaml and serverless.yml resolved as CloudFormation would (``tests.unit.stacks``)
THEN both declare a WEBSOCKET API whose only routes are ``$connect`` (IAM and an API key,
as the REST API's routes), ``$disconnect`` and ``$default``, all proxied to the WebSocket
function, which runs the router's handler package with the router's environment plus the
``WS_*`` settings, keeps its connections in the router's state table (TTL on
``expires_at``), may be invoked by this API only, and the REST API's key reaches the
WebSocket stage through a usage plan. Serverless' ``local`` stage pushes answers to
serverless-offline's WebSocket port; every other stage to the event's own endpoint.
"""

from __future__ import annotations

from typing import Any

import yaml

from infra.checks.cfn_eval import Stack
from spillway.streams.settings import ENV_PREFIX, StreamSettings
from tests.unit.stacks import ROOT, deploy, serverless_config, websocket_route_logical_id

ROUTES = {"$connect", "$disconnect", "$default"}
SAM_ROUTES = {
    "$connect": "WebSocketConnectRoute",
    "$disconnect": "WebSocketDisconnectRoute",
    "$default": "WebSocketDefaultRoute",
}


def _sam_env(name: str) -> dict[str, Any]:
    sam = deploy().sam
    variables: dict[str, Any] = sam.properties(name)["Environment"]["Variables"]
    return variables


def _sls_env(key: str) -> dict[str, Any]:
    environment: dict[str, Any] = serverless_config()["functions"][key]["environment"]
    return environment


def test_sam_routes_are_connect_disconnect_and_default_to_the_function() -> None:
    sam = deploy().sam
    routes = {
        logical: sam.properties(logical)
        for logical, r in sam.resources.items()
        if r["Type"] == "AWS::ApiGatewayV2::Route"
    }
    assert {r["RouteKey"] for r in routes.values()} == ROUTES
    integration = f"integrations/{sam.ref('WebSocketIntegration')}"
    assert {r["Target"] for r in routes.values()} == {integration}
    target = sam.properties("WebSocketIntegration")
    assert target["IntegrationType"] == "AWS_PROXY"
    function = sam.get_att("WebSocketFunction", "Arn")
    assert target["IntegrationUri"].endswith(f"/functions/{function}/invocations")
    api = sam.properties("WebSocketApi")
    assert (api["ProtocolType"], api["RouteSelectionExpression"]) == (
        "WEBSOCKET",
        "$request.body.action",
    )


def _auth(stack: Stack, logical: str) -> tuple[str, bool]:
    route = stack.properties(logical)
    return route["AuthorizationType"], bool(route.get("ApiKeyRequired", False))


def test_connect_needs_iam_and_an_api_key_in_both_forms() -> None:
    d = deploy()
    sam_auth = {route: _auth(d.sam, logical) for route, logical in SAM_ROUTES.items()}
    sls_auth = {route: _auth(d.sls, websocket_route_logical_id(route)) for route in ROUTES}
    expected = {
        "$connect": ("AWS_IAM", True),
        "$disconnect": ("NONE", False),
        "$default": ("NONE", False),
    }
    assert sam_auth == sls_auth == expected
    # AND the key is read where the REST API reads it, and selected messages the same way
    for stack, api in ((d.sam, "WebSocketApi"), (d.sls, "WebsocketsApi")):
        props = stack.properties(api)
        assert props["ApiKeySelectionExpression"] == "$request.header.x-api-key"
        assert props["RouteSelectionExpression"] == "$request.body.action"


def test_serverless_declares_the_same_routes() -> None:
    events = serverless_config()["functions"]["websocket"]["events"]
    assert [e["websocket"]["route"] for e in events] == ["$connect", "$disconnect", "$default"]


def test_the_rest_apis_key_reaches_the_websocket_stage() -> None:
    d = deploy()
    sam_plan = d.sam.resources["WebSocketUsagePlan"]["Properties"]["ApiStages"]
    assert d.sam.resolve(sam_plan) == [{"ApiId": d.sam.ref("WebSocketApi"), "Stage": "prod"}]
    assert d.sam.resources["WebSocketUsagePlanKey"]["Properties"]["KeyId"] == {"Ref": "ApiApiKey"}
    sls_plan = d.sls.resources["WebSocketUsagePlan"]["Properties"]["ApiStages"]
    stage = d.sls.resources["WebsocketsDeploymentStage"]["Properties"]["StageName"]
    assert d.sls.resolve(sls_plan) == [{"ApiId": d.sls.ref("WebsocketsApi"), "Stage": stage}]
    sls_key = d.sls.resources["WebSocketUsagePlanKey"]["Properties"]["KeyId"]
    assert sls_key == {"Ref": "ApiGatewayApiKey1"}  # the key of provider.apiGateway.apiKeys


def test_only_this_api_may_invoke_the_function() -> None:
    sam = deploy().sam
    permission = sam.properties("WebSocketInvokePermission")
    assert permission["Principal"] == "apigateway.amazonaws.com"
    assert permission["FunctionName"] == sam.ref("WebSocketFunction")
    api = sam.ref("WebSocketApi")
    assert permission["SourceArn"] == f"arn:aws:execute-api:us-east-1:123456789012:{api}/*"


def test_the_function_is_the_router_with_the_stream_settings() -> None:
    # GIVEN the router's and the WebSocket function's environments in both forms
    for router, websocket in (
        (_sam_env("RouterFunction"), _sam_env("WebSocketFunction")),
        (_sls_env("router"), _sls_env("websocket")),
    ):
        # THEN every router setting is the router's (the same policy, fallback, tenants,
        # state table), and the WS_* ones are StreamSettings fields
        shared = {k: v for k, v in websocket.items() if k in router}
        assert set(router) - {"POWERTOOLS_SERVICE_NAME"} <= set(shared)
        assert {k: v for k, v in shared.items() if k != "POWERTOOLS_SERVICE_NAME"} == {
            k: v for k, v in router.items() if k != "POWERTOOLS_SERVICE_NAME"
        }
        own = {k.removeprefix(ENV_PREFIX).lower() for k in set(websocket) - set(router)}
        assert own == {
            "max_in_flight",
            "management_endpoint",
            "tracing",
            "tenant_max_connections",
            "tenant_max_in_flight",
            "tenant_frame_rate",
            "tenant_frame_burst",
        }
        assert own <= set(StreamSettings.model_fields)
    sam_fn = deploy().sam.properties("WebSocketFunction")
    assert sam_fn["Handler"] == "functions.websocket.handler.handler"
    assert sam_fn["Layers"] == deploy().sam.properties("RouterFunction")["Layers"]
    sls_fn = serverless_config()["functions"]["websocket"]
    sls_router = serverless_config()["functions"]["router"]
    assert sls_fn["package"] == sls_router["package"]
    assert sls_fn["vpc"] == sls_router["vpc"]


def test_connections_live_in_the_router_state_table_with_its_ttl() -> None:
    d = deploy()
    for stack, env in ((d.sam, _sam_env("WebSocketFunction")), (d.sls, None)):
        table = stack.properties("RouterStateTable")
        assert table["TimeToLiveSpecification"] == {"AttributeName": "expires_at", "Enabled": True}
        if env is not None:
            assert env["ROUTER_STATE_TABLE"] == stack.ref("RouterStateTable")
    assert _sls_env("websocket")["ROUTER_STATE_TABLE"] == _sls_env("router")["ROUTER_STATE_TABLE"]


def test_answers_go_to_serverless_offline_locally_and_to_the_event_endpoint_on_aws() -> None:
    assert _sam_env("WebSocketFunction")["WS_MANAGEMENT_ENDPOINT"] == ""
    assert _sls_env("websocket")["WS_MANAGEMENT_ENDPOINT"] == ""
    params = yaml.safe_load((ROOT / "serverless.yml").read_text(encoding="utf-8"))["params"]
    assert params["default"]["wsManagementEndpoint"] == ""
    assert params["local"]["wsManagementEndpoint"] == "http://127.0.0.1:3001"


def test_the_wss_url_is_an_output() -> None:
    sam = deploy().sam
    url = sam.resolve(sam.template["Outputs"]["WebSocketUrl"]["Value"])
    assert url == f"wss://{sam.ref('WebSocketApi')}.execute-api.us-east-1.amazonaws.com/prod"
