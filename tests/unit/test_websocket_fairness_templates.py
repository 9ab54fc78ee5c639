"""What keeps one tenant's WebSocket burst off another's frames on AWS, in both template
forms, evaluated offline (``tests.unit.stacks``).

GIVEN template.yaml and serverless.yml resolved as CloudFormation would THEN the WebSocket
stage throttles every route (``DefaultRouteSettings``) at its own rate and burst, the
ones the local stand-in (``spillway serve websocket``) enforces; the function gets each
tenant's share of it (``WS_TENANT_*``: connections, frames in flight, frame rate and
burst), at the defaults ``StreamSettings`` documents; and its concurrency may be reserved
in both forms, so a flood of frames cannot take the router's.
"""

from __future__ import annotations

from typing import Any

import yaml

from spillway.streams.settings import ENV_PREFIX, StreamSettings
from spillway_cli.local.websocket.throttle import THROTTLE_BURST, THROTTLE_RATE
from tests.unit.stacks import ROOT, deploy, serverless_config

TENANT_FIELDS = (
    "tenant_max_connections",
    "tenant_max_in_flight",
    "tenant_frame_rate",
    "tenant_frame_burst",
)


def _throttle(settings: dict[str, Any]) -> tuple[float, float]:
    return float(settings["ThrottlingRateLimit"]), float(settings["ThrottlingBurstLimit"])


def test_the_websocket_stage_throttles_as_the_local_stand_in_does() -> None:
    d = deploy()
    sam = d.sam.properties("WebSocketStage")["DefaultRouteSettings"]
    raw = d.sls.resources["WebsocketsDeploymentStage"]["Properties"]["DefaultRouteSettings"]
    sls = d.sls.resolve(raw)
    # THEN both forms throttle the stage at the stand-in's rate and burst
    assert _throttle(sam) == _throttle(sls) == (THROTTLE_RATE, THROTTLE_BURST)
    # AND that is the WebSocket API's own, not the REST API's (frames are many and small)
    rest = d.sam.template["Parameters"]
    assert (float(rest["ApiRateLimit"]["Default"]), float(rest["ApiBurstLimit"]["Default"])) != (
        THROTTLE_RATE,
        THROTTLE_BURST,
    )


def test_the_function_gets_each_tenants_share_at_the_documented_defaults() -> None:
    defaults = StreamSettings()
    sam_env = deploy().sam.properties("WebSocketFunction")["Environment"]["Variables"]
    sls_env = serverless_config()["functions"]["websocket"]["environment"]
    for env in (sam_env, sls_env):
        shares = {name: float(env[f"{ENV_PREFIX}{name.upper()}"]) for name in TENANT_FIELDS}
        assert shares == {name: float(getattr(defaults, name)) for name in TENANT_FIELDS}
        # AND the values are ones the function accepts
        StreamSettings.from_env({k: str(v) for k, v in env.items() if k.startswith(ENV_PREFIX)})


def test_the_functions_concurrency_may_be_reserved_in_both_forms() -> None:
    sam = deploy().sam
    function = sam.template["Resources"]["WebSocketFunction"]["Properties"]
    assert function["ReservedConcurrentExecutions"]["Fn::If"][:2] == [
        "WebSocketHasReservedConcurrency",
        {"Ref": "WebSocketReservedConcurrency"},
    ]
    raw = yaml.safe_load((ROOT / "serverless.yml").read_text(encoding="utf-8"))
    websocket = raw["functions"]["websocket"]["reservedConcurrency"]
    assert websocket == "${param:websocketReservedConcurrency, null}"
    assert "websocketReservedConcurrency" in raw["params"]["default"]
