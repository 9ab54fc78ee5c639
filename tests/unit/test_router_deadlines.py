"""How long the router waits for a request: the request's own latency budget, else the
one its model declares (``spillway.latency_budget_ms``), else the router's default, capped
by the Lambda's time left; what a 504 says; and how the router learns a model's budget
(from a backend's ``config``, once per TTL, one look-up for concurrent requests)."""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from werkzeug.test import Client

from spillway.models.config import ModelConfig
from spillway.policy.backend import BackendRequest, BackendResponse, ConnectFailed, TimedOut
from spillway.router.batch_mode import BatchBackend
from spillway.router.deadlines import (
    CACHED_MODELS,
    ModelBudgets,
    NoAnswer,
    backend_lookup,
    declared_budget,
)
from spillway.router.settings import RouterSettings
from spillway.router.wiring import create_app
from tests.fakes import eventually
from tests.unit.router_support import fake_overrides
from tests.unit.test_router import BODY, Clock, FakeBackend, ok

OCR_BUDGET_MS = 28_000.0
BUDGETS = {"ocr": OCR_BUDGET_MS}


def hang(clock: Clock) -> Any:
    """A backend answer that uses all of the attempt's time, then times out."""

    def answer(request: BackendRequest, timeout_s: float) -> BackendResponse:
        clock.now += timeout_s
        raise TimedOut("slow")

    return answer


class CountingLookup:
    """Budgets from a table; counts the look-ups (``None`` for a name not in it, and no
    answer at all for ``unreachable``). With ``until``, a look-up answers only once that
    holds."""

    def __init__(
        self, table: Mapping[str, float | None], until: Callable[[], bool] | None = None
    ) -> None:
        self.table, self.until = table, until
        self.calls: list[str] = []

    def __call__(self, model: str) -> float | None:
        self.calls.append(model)
        if self.until is not None:
            eventually(self.until, "every request asked", timeout_s=10)
        if model == "unreachable":
            raise NoAnswer(model)
        return self.table.get(model)


class TallyClock(Clock):
    """A clock that counts its reads (each request for a budget reads it once, first)."""

    reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


def stack(
    lookup: CountingLookup | None = None, **settings: Any
) -> tuple[Client, Clock, FakeBackend, FakeBackend]:
    """A router over a GPU and a CPU backend that both hang, its budgets from ``lookup``."""
    clock = Clock()
    gpu, cpu = FakeBackend("gpu", [hang(clock)]), FakeBackend("cpu", [hang(clock)])
    backends: dict[str, Any] = {"gpu": gpu, "cpu": cpu, "batch": BatchBackend(None)}
    budgets = ModelBudgets(lookup or CountingLookup(BUDGETS), ttl_s=60.0, clock=clock)
    overrides = replace(fake_overrides(backends, clock, io.StringIO()), budgets=budgets)
    return Client(create_app(RouterSettings(**settings), overrides)), clock, gpu, cpu


class LambdaContext:
    """What serverless-wsgi hands the router: the invocation's time left."""

    def __init__(self, remaining_ms: int) -> None:
        self.remaining_ms = remaining_ms

    def get_remaining_time_in_millis(self) -> int:
        return self.remaining_ms


def post(
    client: Client, model: str, budget: str | None = None, context: LambdaContext | None = None
) -> Any:
    """An infer request for ``model``, stating ``budget`` (ms) when given, on Lambda when
    a ``context`` is given."""
    headers = {} if budget is None else {"x-spillway-latency-budget-ms": budget}
    environ = {} if context is None else {"serverless.context": context}
    return client.post(
        f"/v2/models/{model}/infer", data=BODY, headers=headers, environ_overrides=environ
    )


# --- which budget -----------------------------------------------------------------------


def test_a_model_s_budget_is_the_deadline_of_a_request_that_states_none() -> None:
    # GIVEN a router that knows ocr declares 28 s, and backends that use all their time
    client, _, gpu, cpu = stack()
    # WHEN a request for ocr states no budget
    answer = post(client, "ocr")
    # THEN the walk had 28 s: 70 % to the GPU, the rest to the CPU fallback
    assert answer.status_code == 504
    assert gpu.timeouts == [pytest.approx(19.6)]
    assert cpu.timeouts == [pytest.approx(8.4)]


def test_the_client_s_budget_wins_over_the_model_s_and_is_not_looked_up() -> None:
    # GIVEN the same router
    lookup = CountingLookup(BUDGETS)
    client, _, gpu, _ = stack(lookup)
    # WHEN a request for ocr states 2 s
    post(client, "ocr", "2000")
    # THEN 2 s it is, and the model's budget was never asked for
    assert gpu.timeouts == [pytest.approx(1.4)]
    assert lookup.calls == []


def test_a_model_without_a_budget_gets_the_router_s_default() -> None:
    # GIVEN a router whose default is 5 s; digits declares no budget
    client, _, gpu, _ = stack(default_deadline_ms=5000)
    # WHEN a request for digits states none
    post(client, "digits")
    # THEN the default serves
    assert gpu.timeouts == [pytest.approx(3.5)]


@pytest.mark.parametrize("value", ["50", "3600001"])
def test_a_client_budget_out_of_bounds_is_refused_whatever_the_model_declares(value: str) -> None:
    # GIVEN a model with a budget
    client, _, gpu, _ = stack()
    # WHEN a request states a budget outside 100 ms .. 1 h
    answer = post(client, "ocr", value)
    # THEN it is the client's error, as before, and no backend was asked
    assert answer.status_code == 400
    assert "between 100 and 3600000" in answer.json["error"]
    assert gpu.requests == []


def test_the_lambda_s_time_left_caps_a_model_s_budget() -> None:
    # GIVEN a router with 10 s left of its invocation (margin 150 ms)
    client, _, gpu, _ = stack(deadline_margin_ms=150)
    # WHEN a request for ocr (28 s) states no budget
    answer = post(client, "ocr", context=LambdaContext(10_000))
    # THEN 9,850 ms is all it gets, and the 504 says the invocation's time ran out
    assert gpu.timeouts == [pytest.approx(9.85 * 0.7)]
    assert answer.json["error"] == (
        "the 9850 ms deadline (the time left of the router's invocation, short of the 28000 "
        "ms latency budget of model 'ocr'; send Prefer: respond-async for longer work) "
        "passed before a backend answered (gpu: timeout, cpu: timeout)"
    )


# --- what the 504 says --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "budget", "message"),
    [
        (
            "digits",
            None,
            "the 5000 ms deadline (the router's default; send x-spillway-latency-budget-ms "
            "or set the model's spillway.latency_budget_ms) passed before a backend answered "
            "(gpu: timeout, cpu: timeout)",
        ),
        (
            "ocr",
            None,
            "the 28000 ms deadline (the latency budget of model 'ocr'; send "
            "x-spillway-latency-budget-ms for another) passed before a backend answered "
            "(gpu: timeout, cpu: timeout)",
        ),
        (
            "ocr",
            "400",
            "the 400 ms deadline (the request's own latency budget, "
            "x-spillway-latency-budget-ms) passed before a backend answered "
            "(gpu: timeout, cpu: timeout)",
        ),
    ],
    ids=["default", "model", "request"],
)
def test_a_504_names_the_budget_that_passed_and_how_to_give_another(
    model: str, budget: str | None, message: str
) -> None:
    # GIVEN backends that use all their time
    client, _, _, _ = stack()
    # WHEN a request is routed
    answer = post(client, model, budget)
    # THEN the 504 names the deadline, whose budget it was, and the knob
    assert answer.status_code == 504
    assert answer.json == {"error": message, "code": "deadline_exceeded"}


# --- learning a model's budget --------------------------------------------------------------


def test_a_model_s_budget_is_asked_once_per_ttl() -> None:
    # GIVEN budgets cached 60 s
    clock, lookup = Clock(), CountingLookup(BUDGETS)
    budgets = ModelBudgets(lookup, ttl_s=60.0, clock=clock)
    # WHEN ocr's budget is asked for 100 times within 60 s, and once after
    assert {budgets.budget_ms("ocr") for _ in range(100)} == {OCR_BUDGET_MS}
    clock.now += 60
    assert budgets.budget_ms("ocr") == OCR_BUDGET_MS
    # THEN the backends were asked twice
    assert lookup.calls == ["ocr", "ocr"]


def test_concurrent_requests_share_one_look_up() -> None:
    # GIVEN a look-up that answers only once all 8 requests have asked
    clock = TallyClock()
    lookup = CountingLookup(BUDGETS, until=lambda: clock.reads >= 8)
    budgets = ModelBudgets(lookup, ttl_s=60.0, clock=clock)
    found: list[float | None] = []
    threads = [
        threading.Thread(target=lambda: found.append(budgets.budget_ms("ocr"))) for _ in range(8)
    ]
    # WHEN 8 requests for ocr ask at once
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    # THEN one look-up answered all of them
    assert lookup.calls == ["ocr"]
    assert found == [OCR_BUDGET_MS] * 8


def test_a_look_up_nobody_answered_is_tried_again_soon_and_keeps_what_was_known() -> None:
    # GIVEN ocr's budget known, then the backends unreachable
    clock = Clock()
    lookup = CountingLookup(BUDGETS)
    budgets = ModelBudgets(lookup, ttl_s=60.0, clock=clock, retry_s=5.0)
    assert budgets.budget_ms("ocr") == OCR_BUDGET_MS
    lookup.table = {}
    # WHEN a name no backend answers for is asked twice within 5 s, then after
    assert budgets.budget_ms("unreachable") is None
    assert budgets.budget_ms("unreachable") is None
    clock.now += 5
    assert budgets.budget_ms("unreachable") is None
    # THEN it was asked once per 5 s
    assert lookup.calls == ["ocr", "unreachable", "unreachable"]


def test_invented_names_cost_one_look_up_each_and_stay_bounded() -> None:
    # GIVEN budgets cached 60 s
    clock, lookup = Clock(), CountingLookup(BUDGETS)
    budgets = ModelBudgets(lookup, ttl_s=60.0, clock=clock)
    # WHEN a client asks twice for each of more names than the cache keeps
    names = [f"invented-{i}" for i in range(CACHED_MODELS + 10)]
    for name in names:
        assert budgets.budget_ms(name) is None
        assert budgets.budget_ms(name) is None
    # THEN each name was looked up once (no more than its request's own forward), and the
    # cache holds at most CACHED_MODELS names
    assert lookup.calls == names
    assert len(budgets._known) == CACHED_MODELS


def _config(budget: Any) -> bytes:
    return json.dumps({"name": "ocr", "spillway": {"latency_budget_ms": budget}}).encode()


def test_the_budget_comes_from_the_gpu_service_s_config_else_the_cpu_fallback_s() -> None:
    # GIVEN a GPU service that serves ocr's config, and one that cannot be reached
    served = ok(body=_config(28000))
    gpu, cpu = FakeBackend("gpu", [served]), FakeBackend("cpu", [served])
    # WHEN the budget is looked up
    budget = backend_lookup({"gpu": gpu, "cpu": cpu}, 0.5)("ocr")
    # THEN the GPU answered, for the canonical config path, within the look-up's timeout
    assert budget == 28000
    assert [(r.method, r.path) for r in gpu.requests] == [("GET", "/v2/models/ocr/config")]
    assert gpu.timeouts == [0.5]
    assert cpu.requests == []
    # AND with the GPU unreachable the CPU fallback answers; a 404 says the name is unknown
    down = FakeBackend("gpu", [ConnectFailed("refused")])
    assert backend_lookup({"gpu": down, "cpu": cpu}, 0.5)("ocr") == 28000
    unknown = FakeBackend("gpu", [ok(404, b'{"error":"no","code":"model_not_found"}')])
    assert backend_lookup({"gpu": unknown, "cpu": cpu}, 0.5)("nope") is None
    # AND when neither answers, nobody could tell
    busy = FakeBackend("cpu", [ok(503, b"{}")])
    with pytest.raises(NoAnswer):
        backend_lookup({"gpu": down, "cpu": busy}, 0.5)("ocr")


@pytest.mark.parametrize(
    ("body", "budget"),
    [
        (_config(28000), 28000.0),
        (_config(50), None),  # below a request's own bound
        (_config(3_600_001), None),
        (_config("soon"), None),
        (json.dumps({"name": "digits"}).encode(), None),
        (b"[]", None),
        (b"not json", None),
    ],
)
def test_a_served_budget_counts_only_within_a_request_s_bounds(
    body: bytes, budget: float | None
) -> None:
    assert declared_budget(body) == budget


# --- the model's configuration -------------------------------------------------------------


def _model(**block: Any) -> dict[str, Any]:
    return {
        "name": "m",
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [1]}],
        "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [1]}],
        "spillway": block,
    }


@pytest.mark.parametrize("budget", [99, 3_600_001, float("nan"), float("inf")])
def test_a_config_s_budget_has_a_request_s_bounds(budget: float) -> None:
    with pytest.raises(ValueError, match="latency_budget_ms"):
        ModelConfig.model_validate(_model(latency_budget_ms=budget))
    assert (
        ModelConfig.model_validate(_model(latency_budget_ms=100)).spillway.latency_budget_ms == 100
    )


def test_a_pipeline_s_budget_is_at_most_its_timeout() -> None:
    from spillway_cli.modelbuild.ocr_pipelines import ocr_config

    document = ocr_config().model_dump(mode="json")
    document["spillway"]["latency_budget_ms"] = 60_001
    with pytest.raises(ValueError, match="exceeds the pipeline's timeout_s"):
        ModelConfig.model_validate(document)


def test_the_ocr_pipelines_declare_a_page_s_budget() -> None:
    from spillway_cli.modelbuild.ocr_pipelines import (
        PAGE_BUDGET_MS,
        ocr_config,
        ocr_topics_config,
    )

    # GIVEN the OCR pipelines as the build writes them
    # THEN each declares the page budget: longer than the router's default, within the
    # router function's 29 s (API Gateway's limit) less its margin, and a valid config
    default_ms = RouterSettings().default_deadline_ms
    margin_ms = RouterSettings().deadline_margin_ms
    for config in (ocr_config(), ocr_topics_config()):
        assert config.spillway.latency_budget_ms == PAGE_BUDGET_MS
        assert default_ms < PAGE_BUDGET_MS <= 29_000 - margin_ms
        assert ModelConfig.model_validate(config.model_dump(mode="json")) == config


# --- what the policy sees ------------------------------------------------------------------

LONG_WORK_POLICY = """
version: 1
fallbacks: {gpu: [cpu], cpu: [gpu]}
rules:
  - name: long-work
    description: Work with a budget of 10 s or more goes to the CPU fallback first.
    match:
      latency_budget_ms: {ge: 10000}
    route: cpu
  - name: default
    match: {}
    route: gpu
"""


@pytest.mark.parametrize(
    ("model", "budget", "first", "walk_s"),
    [
        ("ocr", None, "cpu", 28.0),
        ("ocr", "2000", "gpu", 2.0),
        ("digits", None, "gpu", 5.0),
        ("digits", "20000", "cpu", 20.0),
    ],
    ids=["model-declared", "client-shorter", "router-default", "client-declared"],
)
def test_a_rule_on_the_budget_sees_the_model_s_when_the_client_states_none(
    tmp_path: Path, model: str, budget: str | None, first: str, walk_s: float
) -> None:
    # GIVEN a policy that sends work with 10 s or more to the CPU fallback first, and a
    # router that knows ocr declares 28 s (digits declares none: the 5 s default)
    policy = tmp_path / "policy.yaml"
    policy.write_text(LONG_WORK_POLICY)
    client, _, gpu, cpu = stack(policy_file=policy)
    # WHEN a request states this budget, or none
    post(client, model, budget)
    # THEN the rule saw the client's budget, else the model's, never the router's
    # default: the backend it chose first had 70 % of the walk, the other the rest
    second = {"gpu": cpu, "cpu": gpu}[first]
    assert {"gpu": gpu, "cpu": cpu}[first].timeouts == [pytest.approx(walk_s * 0.7)]
    assert second.timeouts == [pytest.approx(walk_s * 0.3)]
