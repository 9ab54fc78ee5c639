"""What is left of an invocation, as the router and the WebSocket function read it:
Lambda's own count, as it is, wherever they run. Under serverless-offline, whose Python
runner starts every invocation at 6 s whatever the function's timeout, the local stack's
adapter (``spillway_cli.local.offline_handlers``, the handlers serverless.yml's ``local``
stage names) hands them a context counting from the 29 s both template forms give the
functions behind API Gateway; the production code knows nothing of serverless-offline."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from spillway.powertools import API_GATEWAY_TIMEOUT_S, remaining_ms
from spillway_cli.local import offline_handlers
from spillway_cli.local.offline_handlers import HANDLERS, OfflineContext, under_serverless_offline

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION = ("spillway", "functions", "gpu_service", "batch_job")
OFFLINE_RUNNER = (
    ROOT / "node_modules/serverless-offline/src/lambda/handler-runner/python-runner/invoke.py"
)


@dataclass
class OfflineLikeContext:
    """serverless-offline's ``FakeLambdaContext`` as its runner builds it: ``timeout`` 6,
    whatever the function's."""

    spent_ms: float
    timeout: int = 6
    function_name: str = "Fake"

    def get_remaining_time_in_millis(self) -> int:
        return int(max(self.timeout * 1000 - self.spent_ms, 0))


@dataclass
class LambdaContext:
    left_ms: int

    def get_remaining_time_in_millis(self) -> int:
        return self.left_ms


def test_the_production_code_takes_lambda_s_count_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # GIVEN serverless-offline's marker in the environment, or not
    for offline in (None, "true"):
        if offline is None:
            monkeypatch.delenv("IS_OFFLINE", raising=False)
        else:
            monkeypatch.setenv("IS_OFFLINE", offline)
        # THEN what the context says is what is left, a 6 s context included
        assert remaining_ms(LambdaContext(27_500)) == 27_500.0
        assert remaining_ms(OfflineLikeContext(spent_ms=1_000)) == 5_000.0
        assert remaining_ms(None) is None
        assert remaining_ms(object()) is None


def test_serverless_offline_s_six_seconds_are_read_as_the_function_s_timeout() -> None:
    # GIVEN serverless-offline's contexts 1 s and 5.5 s into an invocation
    early = OfflineContext(OfflineLikeContext(spent_ms=1_000))
    late = OfflineContext(OfflineLikeContext(spent_ms=5_500))
    # THEN what is left counts from 29 s, as on AWS
    assert API_GATEWAY_TIMEOUT_S == 29
    assert remaining_ms(early) == 28_000.0
    assert remaining_ms(late) == 23_500.0
    # AND a context that says its own timeout, or none, is taken as it is
    assert remaining_ms(OfflineContext(OfflineLikeContext(spent_ms=1_000, timeout=10))) == 9_000.0
    assert remaining_ms(OfflineContext(LambdaContext(12_000))) == 12_000.0
    # AND the rest of the context is serverless-offline's
    assert early.function_name == "Fake"


def test_the_adapted_handler_is_handed_the_adapted_context() -> None:
    # GIVEN a handler that reads what is left, behind the adapter
    seen: list[tuple[dict[str, Any], float | None]] = []

    def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
        seen.append((event, remaining_ms(context)))
        return {"statusCode": 200}

    adapted = under_serverless_offline(handler)
    # WHEN serverless-offline invokes it 2 s in
    answer = adapted({"path": "/"}, OfflineLikeContext(spent_ms=2_000))
    # THEN the handler got the event and 27 s, and its answer is returned as it is
    assert answer == {"statusCode": 200}
    assert seen == [({"path": "/"}, 27_000.0)]


def test_serverless_yml_runs_the_adapter_locally_and_the_handlers_on_aws() -> None:
    config = yaml.safe_load((ROOT / "serverless.yml").read_text(encoding="utf-8"))
    default, local = config["params"]["default"], config["params"]["local"]
    for name, production in HANDLERS.items():
        # GIVEN the function behind API Gateway the adapter serves
        param = f"{name}Handler"
        # THEN the function's handler is the stage's parameter: the production handler by
        # default (what is deployed), the adapter at stage local (serverless-offline)
        assert config["functions"][name]["handler"] == f"${{param:{param}}}"
        assert default[param] == production
        assert local[param] == f"{offline_handlers.__name__}.{name}"


def test_only_the_named_handlers_are_served() -> None:
    with pytest.raises(AttributeError, match="no attribute 'jobs'"):
        offline_handlers.jobs  # noqa: B018 - the lookup is what is tested


@pytest.mark.skipif(not OFFLINE_RUNNER.is_file(), reason="serverless-offline is not installed")
def test_the_runner_s_own_context_counts_from_29_s() -> None:
    # GIVEN serverless-offline's own context class, as its runner builds one
    spec = importlib.util.spec_from_file_location("offline_invoke", OFFLINE_RUNNER)
    assert spec is not None
    assert spec.loader is not None
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    fresh = runner.FakeLambdaContext(functionName="spillway-local-router")
    # THEN its 6 s become 29 s behind the adapter (within the time this test took)
    assert 5_000 < fresh.get_remaining_time_in_millis() <= 6_000
    assert 28_000 < OfflineContext(fresh).get_remaining_time_in_millis() <= 29_000


def test_no_production_module_knows_serverless_offline() -> None:
    # serverless-offline's marker variable is read by the local stack's adapter alone
    readers = [
        path.relative_to(ROOT).as_posix()
        for top in PRODUCTION
        for path in sorted((ROOT / top).rglob("*.py"))
        if re.search(r"\bIS_OFFLINE\b", path.read_text(encoding="utf-8"))
    ]
    assert readers == []
