"""What is left of an invocation, as the router and the WebSocket function read it:
Lambda's own count as it is; serverless-offline's Python runner, which starts every
invocation at 6 s whatever the function's timeout, read as the 29 s both template forms
give the functions behind API Gateway (and only there: ``IS_OFFLINE``)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from spillway.powertools import API_GATEWAY_TIMEOUT_S, remaining_ms


@dataclass
class OfflineContext:
    """serverless-offline's ``FakeLambdaContext`` as its runner builds it: ``timeout`` 6,
    whatever the function's."""

    spent_ms: float
    timeout: int = 6

    def get_remaining_time_in_millis(self) -> int:
        return int(max(self.timeout * 1000 - self.spent_ms, 0))


@dataclass
class LambdaContext:
    left_ms: int

    def get_remaining_time_in_millis(self) -> int:
        return self.left_ms


def test_lambda_s_count_is_taken_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("IS_OFFLINE", raising=False)
    assert remaining_ms(LambdaContext(27_500)) == 27_500.0
    assert remaining_ms(None) is None
    assert remaining_ms(object()) is None
    # a context with a timeout of 6 outside serverless-offline is believed too
    assert remaining_ms(OfflineContext(spent_ms=1_000)) == 5_000.0


def test_serverless_offline_s_six_seconds_are_read_as_the_function_s_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("IS_OFFLINE", "true")
    # GIVEN invocations 1 s and 5.5 s in
    early, late = OfflineContext(spent_ms=1_000), OfflineContext(spent_ms=5_500)
    # THEN what is left counts from 29 s, as on AWS
    assert API_GATEWAY_TIMEOUT_S == 29
    assert remaining_ms(early) == 28_000.0
    assert remaining_ms(late) == 23_500.0
    # AND a context that says its own timeout is taken as it is
    assert remaining_ms(OfflineContext(spent_ms=1_000, timeout=10)) == 9_000.0
    assert remaining_ms(LambdaContext(12_000)) == 12_000.0
