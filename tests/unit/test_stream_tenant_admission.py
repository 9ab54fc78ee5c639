"""Each tenant's share, as the WebSocket gateway applies it before a frame is routed: a
``$connect`` past the tenant's cap refused 429 ``too_many_connections`` while another
tenant connects, and counted out at ``$disconnect``; a frame past the tenant's frames in
flight or rate answered ``slow_down`` at once, never routed, its ``seq`` left open and
counted refused on its connection; the frame's slot given back however it ended."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from spillway.policy.facts import Call
from spillway.protocol.replies import Reply, json_reply
from spillway.protocol.wire import Target
from spillway.streams.gateway import StreamGateway
from spillway.streams.settings import StreamSettings
from spillway.streams.tenants import IN_FLIGHT, RATE, FrameAdmission
from spillway.tenancy.identity import Authenticator
from tests.unit.stream_support import ENDPOINT, MemoryConnections, MemoryPoster, text, ws_event

TENANTS = {"key-acme": "acme", "key-globex": "globex"}
INPUTS = [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]


@dataclass
class Budgets:
    """``TenantBudgets`` in memory: connection caps as given, a frame refused with the
    refusal queued for its tenant in ``refuse``."""

    connections: dict[str | None, set[str]] = field(default_factory=dict)
    slots: dict[str | None, set[str]] = field(default_factory=dict)
    refuse: dict[str | None, list[str]] = field(default_factory=dict)
    released: list[str] = field(default_factory=list)

    def connect(self, tenant: str | None, connection_id: str, now: float, cap: int) -> bool:
        held = self.connections.setdefault(tenant, set())
        if connection_id not in held and len(held) >= cap:
            return False
        held.add(connection_id)
        return True

    def disconnect(self, tenant: str | None, connection_id: str) -> None:
        self.connections.get(tenant, set()).discard(connection_id)

    def admit(
        self, tenant: str | None, token: str, now: float, limit: int, rate: float, burst: int
    ) -> FrameAdmission:
        slots = self.slots.setdefault(tenant, set())
        refusals = self.refuse.get(tenant) or []
        if refusals:
            return FrameAdmission(refusals.pop(0), len(slots), retry_after_s=0.25)
        slots.add(token)
        return FrameAdmission(None, len(slots))

    def release(self, tenant: str | None, token: str) -> None:
        self.slots[tenant].discard(token)
        self.released.append(token)


@dataclass
class Router:
    """Answers every call 200 with its tenant; records the calls."""

    calls: list[Call] = field(default_factory=list)

    def route(self, call: Call, target: Target) -> Reply:
        self.calls.append(call)
        body = {"model_name": target.model, "outputs": [{"name": "t", "data": [1]}]}
        return json_reply(200, body, [("x-spillway-backend", "gpu")])


def _gateway(budgets: Budgets, **settings: Any) -> tuple[StreamGateway, MemoryPoster, Router]:
    poster, router = MemoryPoster(), Router()
    gateway = StreamGateway(
        router,
        MemoryConnections(),
        poster,
        StreamSettings(management_endpoint=ENDPOINT, **settings),
        Authenticator(identity_tenants=TENANTS),
        clock=lambda: 1_000_000.0,
        budgets=budgets,
    )
    return gateway, poster, router


def test_a_connect_past_the_tenants_cap_is_refused_while_another_tenant_connects() -> None:
    budgets = Budgets()
    gateway, _, _ = _gateway(budgets, tenant_max_connections=2)
    # GIVEN acme holding its cap of 2 connections
    for name in ("a1", "a2"):
        assert gateway.handle(ws_event("$connect", name, api_key_id="key-acme")) == {
            "statusCode": 200
        }
    # WHEN acme connects a third time and globex once
    refused = gateway.handle(ws_event("$connect", "a3", api_key_id="key-acme"))
    globex = gateway.handle(ws_event("$connect", "g1", api_key_id="key-globex"))
    # THEN acme's upgrade is refused 429 too_many_connections, globex's accepted
    assert refused["statusCode"] == 429
    body = json.loads(refused["body"])
    assert body["code"] == "too_many_connections"
    assert "2 connections open" in body["error"]
    assert globex == {"statusCode": 200}
    # AND once one of acme's disconnects, acme connects again
    gateway.handle(ws_event("$disconnect", "a1"))
    assert gateway.handle(ws_event("$connect", "a3", api_key_id="key-acme")) == {"statusCode": 200}
    assert budgets.connections == {"acme": {"a2", "a3"}, "globex": {"g1"}}


def test_a_frame_past_the_tenants_budget_is_told_to_slow_down_and_never_routed() -> None:
    budgets = Budgets(refuse={"acme": [IN_FLIGHT, RATE]})
    gateway, poster, router = _gateway(budgets, tenant_max_in_flight=7, tenant_frame_rate=50)
    for name, key in (("a1", "key-acme"), ("g1", "key-globex")):
        gateway.handle(ws_event("$connect", name, api_key_id=key))
    # WHEN acme's tenant is over its frames in flight, then over its rate, and globex sends
    for frame_id in ("f0", "f1"):
        frame = text(id=frame_id, seq=0, model="m", inputs=INPUTS)
        gateway.handle(ws_event("$default", "a1", frame))
    gateway.handle(ws_event("$default", "g1", text(id="g0", model="m", inputs=INPUTS)))
    # THEN acme's frames are answered slow_down at once, saying which budget
    first, second = poster.answers("a1")
    assert (first["id"], first["code"], first["status"]) == ("f0", "slow_down", 429)
    assert (first["in_flight"], first["limit"]) == (0, 7)
    assert "of this tenant in flight (limit 7)" in first["error"]
    assert (second["code"], second["retry_after_s"]) == ("slow_down", 0.25)
    assert "frame rate (50 frames/s)" in second["error"]
    # AND only globex's frame reached the router
    assert [c.trusted_tenant for c in router.calls] == ["globex"]
    assert poster.answers("g1")[0]["id"] == "g0"
    # AND seq 0 stays open on acme's connection: sent again, it is served
    gateway.handle(ws_event("$default", "a1", text(id="f2", seq=0, model="m", inputs=INPUTS)))
    assert poster.answers("a1")[-1]["id"] == "f2"
    assert "outputs" in poster.answers("a1")[-1]
    # AND the refusals count on the connection; nothing is left in flight or in a slot
    gateway.handle(ws_event("$default", "a1", text(id="s", action="stats")))
    stats = poster.answers("a1")[-1]["connection"]
    assert (stats["frames_refused"], stats["frames_answered"], stats["in_flight"]) == (2, 1, 1)
    assert budgets.slots == {"acme": set(), "globex": set()}
    assert len(budgets.released) == 3
