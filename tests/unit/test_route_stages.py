"""``Router.route`` reads as three stages: decide, walk (through the version-choice
stage), account. Following one request through it, with a canary or without, route
itself calls into at most ``MAX_MODULES`` project modules and enters the version-choice
stage (``spillway.canary.stage``) at most twice, to pick and to settle; the router's
module branches on no canary, and the stage's stand-in sends every request as it came.
"""

from __future__ import annotations

import ast
import inspect
import io
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from types import FrameType
from typing import Any, cast

import pytest
from werkzeug.test import Client

from spillway.async_inference.settings import AsyncSettings
from spillway.async_inference.store import AsyncStore
from spillway.canary.records import CanaryStore
from spillway.canary.stage import NO_CANARY, VERSION_NOT_SERVED
from spillway.policy.backend import Backend, BackendResponse
from spillway.policy.facts import Call, read_request
from spillway.protocol.replies import Reply
from spillway.protocol.wire import Target
from spillway.router import dispatch
from spillway.router.batch_mode import BatchBackend
from spillway.router.dispatch import Router
from spillway.router.outcome import Attempt
from spillway.router.settings import RouterSettings
from spillway.router.wiring import create_app
from tests.memory_store import MemoryStateStore
from tests.unit.canary_support import BODY, PATH, VERSION, Clock, VersionedBackend
from tests.unit.router_support import fake_overrides

MAX_MODULES = 5
PROJECT = ("spillway.", "functions.", "gpu_service.", "batch_job.")


@dataclass
class _Queued:
    id: str
    state: str = "queued"


@dataclass
class QueueingStore:
    """An async store that queues nothing and notes the version of each request."""

    versions: list[str | None] = field(default_factory=list)
    settings: AsyncSettings = field(default_factory=AsyncSettings)

    def submit(self, *, version: str | None, **_: Any) -> tuple[_Queued, bool]:
        self.versions.append(version)
        return _Queued(f"r{len(self.versions)}"), False

    def areas(self, tenant: str | None) -> list[str]:
        return []


@dataclass
class Scene:
    """A router over a GPU and a CPU backend; ``canary``: digits v2 at 100 % over v1."""

    client: Client
    queue: QueueingStore


def scene(*, canary: bool, missing: frozenset[int] = frozenset()) -> Scene:
    """``missing``: the versions neither backend serves."""
    clock = Clock()
    gpu = VersionedBackend(clock, missing=set(missing), name="gpu")
    cpu = VersionedBackend(clock, missing=set(missing), name="cpu")
    backends: dict[str, Backend] = {"gpu": gpu, "cpu": cpu, "batch": BatchBackend(None)}
    store = MemoryStateStore() if canary else None
    queue = QueueingStore()
    overrides = replace(
        fake_overrides(backends, clock, io.StringIO(), state=store),
        async_store=cast(AsyncStore, queue),
    )
    app = create_app(RouterSettings(canary_seed=5), overrides)
    if store is not None:
        CanaryStore(store, clock).start("digits", 2, 100, stable=1)
    return Scene(Client(app), queue)


@contextmanager
def called_from(function: Callable[..., Any]) -> Iterator[list[str]]:
    """The modules of the project functions called directly from ``function``'s frame
    (in call order, repeats kept) while the block runs."""
    code = function.__code__
    modules: list[str] = []

    def profile(frame: FrameType, event: str, _: object) -> None:
        caller = frame.f_back
        if event == "call" and caller is not None and caller.f_code is code:
            module = str(frame.f_globals.get("__name__", "?"))
            if module.startswith(PROJECT):
                modules.append(module)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield modules
    finally:
        sys.setprofile(previous)


def _distinct(modules: list[str]) -> list[str]:
    return list(dict.fromkeys(modules))


CASES = {
    "without a canary": ({"canary": False}, {}, None),
    "with a canary": ({"canary": True}, {}, "2"),
    "canary unserved, walked again on stable": (
        {"canary": True, "missing": frozenset({2})},
        {},
        "1",
    ),
    "async without a canary": ({"canary": False}, {"x-spillway-mode": "async"}, None),
    "async with a canary": ({"canary": True}, {"x-spillway-mode": "async"}, "2"),
}


@pytest.mark.parametrize(("setup", "headers", "version"), CASES.values(), ids=CASES.keys())
def test_one_request_through_route_visits_at_most_five_modules(
    setup: dict[str, Any], headers: dict[str, str], version: str | None
) -> None:
    # GIVEN a router with or without a canary record for digits
    s = scene(**setup)
    # WHEN one request that pins no version is routed, its calls from route's frame traced
    with called_from(Router.route) as modules:
        answer = s.client.post(PATH, data=BODY, headers=headers)
    # THEN it was answered, with the version the scene implies (the backends' default, or
    # none queued, without a canary; the stable one when no backend serves the canary)
    assert answer.status_code in (200, 202), answer.data
    if headers:
        assert s.queue.versions == [version]
    else:
        assert answer.headers.get(VERSION) == (version or "1")
    # AND route itself called into at most five project modules
    distinct = _distinct(modules)
    assert distinct, "the trace saw no call from Router.route"
    assert len(distinct) <= MAX_MODULES, (
        f"Router.route calls into {len(distinct)} modules: {distinct}"
    )
    # AND it entered the version-choice stage at most twice: to pick, and to settle
    stage = [m for m in modules if m.startswith("spillway.canary.")]
    assert len(stage) <= 2, f"Router.route enters the canary {len(stage)} times: {modules}"


def _conditions(tree: ast.AST) -> Iterator[str]:
    """The source of every condition a module branches on."""
    for node in ast.walk(tree):
        if isinstance(node, ast.If | ast.IfExp | ast.While | ast.Assert):
            yield ast.unparse(node.test)
        elif isinstance(node, ast.BoolOp | ast.Match):
            yield ast.unparse(node)
        elif isinstance(node, ast.comprehension):
            yield from (ast.unparse(test) for test in node.ifs)


def test_the_dispatch_module_has_no_canary_branch() -> None:
    # GIVEN the router's module source
    source = inspect.getsource(dispatch)
    # THEN no condition in it mentions a canary: the version-choice stage (a canary's, or
    # its stand-in) answers every question that depends on one
    branches = [c for c in _conditions(ast.parse(source)) if "canar" in c.lower()]
    assert branches == [], branches
    assert "canaries is not None" not in source


def test_the_stand_in_stage_sends_every_request_as_it_came() -> None:
    # GIVEN the stage of a router without canaries, and a request that pins no version
    request = read_request(Call("POST", {}, BODY, "r-1"), Target("infer", "digits"))
    missing = BackendResponse(404, {}, b'{"error":"no","code":"model_not_found"}', 0.001)
    reply = Reply(200, [("content-type", "application/json")], b"{}")
    # WHEN it gives the request its arm
    arm = NO_CANARY.pick(request)
    # THEN the request goes as sent, no backend is passed over, a 404 is the client's
    # answer, nothing is walked again, and the reply leaves as it is
    assert arm.request is request
    assert arm.skips("gpu") is False
    assert arm.unserved("gpu", missing) is False
    assert arm.walk_again([Attempt("gpu", VERSION_NOT_SERVED)]) is None
    assert arm.settle(missing, 0.01, reply) is reply
