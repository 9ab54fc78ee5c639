"""The local Step Functions stand-in refuses what Step Functions refuses, and async
requests run as executions stay answerable within its rules.

Step Functions' rules (``spillway.aws.limits``; API_StartExecution,
concepts-error-handling): an execution name is 1-80 characters without whitespace,
brackets, wildcards, ``"#%\\^|~`$&,;:/`` or control characters; a Standard execution's
name stays taken for 90 days after it ends (``ExecutionAlreadyExists`` whatever the
input), a running one with the same input is the same execution; an input is at most
262,144 bytes; a state's data past that fails the execution with
``States.DataLimitExceeded``, which no catcher takes.

The async path names each execution by its request id and attempt, so a client's
``Idempotency-Key`` used again after its record expired (a day) starts a new execution
instead of a 503, and a start whose answer was lost is retried into the execution it
already started.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError
from werkzeug.test import Client, TestResponse

from spillway.async_inference.settings import AsyncSettings
from spillway.async_inference.store import AsyncStore
from spillway.aws.limits import (
    SFN_EXECUTION_NAME_CHARS,
    SFN_PAYLOAD_BYTES,
)
from spillway.protocol.replies import json_reply
from spillway.router.settings import RouterSettings
from spillway.router.wiring import Overrides, create_app
from spillway_cli.local.async_resources import create_async_resources
from spillway_cli.local.states import LocalStateMachine
from spillway_cli.local.step_functions import LocalStepFunctions
from spillway_cli.local.wsgi_server import running

MACHINE = "arn:aws:states:us-east-1:123456789012:stateMachine:spillway-echo"
KEYS = {"acme": "key-acme", "globex": "key-globex"}
WAIT_S = 30.0
_INVOKE = "arn:aws:states:::lambda:invoke"


class Clock:
    """The async store's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def _task(function: str, then: str | None = None, **fields: Any) -> dict[str, Any]:
    state: dict[str, Any] = {
        "Type": "Task",
        "Resource": _INVOKE,
        "Parameters": {"FunctionName": function, "Payload": {"id.$": "$.id"}},
        "ResultPath": "$.answer",
        **fields,
    }
    return {**state, "Next": then} if then else {**state, "End": True}


def _machine(functions: dict[str, Callable[[dict[str, Any]], Any]]) -> LocalStateMachine:
    """One state that settles the request (the ``settle`` function)."""
    definition = {"StartAt": "Settle", "States": {"Settle": _task("settle")}}
    return LocalStateMachine(definition, functions=functions)


def _sfn(url: str) -> Any:
    """A Step Functions client on the stand-in that makes one attempt per call."""
    config = Config(retries={"mode": "standard", "max_attempts": 1})
    return boto3.client("stepfunctions", endpoint_url=url, config=config)


@dataclass
class Stack:
    """The router (async mode, ``echo`` runs as an execution) and the stand-in."""

    router: Client
    states: LocalStepFunctions
    store: AsyncStore
    clock: Clock

    def submit(self, who: str, key: str, text: str = "hello") -> TestResponse:
        body = json.dumps(
            {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [text]}]}
        )
        event = {"requestContext": {"identity": {"apiKeyId": KEYS[who]}}}
        return self.router.post(
            "/v2/models/echo/infer",
            data=body,
            headers={
                "prefer": "respond-async",
                "content-type": "application/json",
                "idempotency-key": key,
            },
            environ_overrides={"serverless.event": event},
        )

    def result(self, who: str, rid: str) -> TestResponse:
        event = {"requestContext": {"identity": {"apiKeyId": KEYS[who]}}}
        return self.router.get(f"/v1/results/{rid}", environ_overrides={"serverless.event": event})

    def finish(self, rid: str) -> str:
        """Wait for the request's current execution; its status."""
        record = self.store.find(rid)
        assert record is not None
        assert record.execution is not None
        return self.states.wait(record.execution, WAIT_S).status


def _stack(
    settings: AsyncSettings, clock: Clock, states: LocalStepFunctions, tmp_path: Path
) -> Stack:
    store = AsyncStore(settings, clock=clock)
    router_settings = RouterSettings(
        gpu_url=None,
        metrics_log=tmp_path / "metrics.log",
        identity_tenants={key: tenant for tenant, key in KEYS.items()},
    )
    app = create_app(router_settings, Overrides(async_store=store))
    return Stack(Client(app), states, store, clock)


@pytest.fixture
def resources(aws_env: str) -> AsyncSettings:
    suffix = uuid.uuid4().hex[:8]
    made = create_async_resources(
        f"limits-{suffix}", names=(f"t-{suffix}", f"q-{suffix}", f"dlq-{suffix}")
    )
    return AsyncSettings.model_validate({**made.model_dump(), "state_machines": {"echo": MACHINE}})


def _settler(settings: AsyncSettings, clock: Clock) -> Callable[[dict[str, Any]], Any]:
    """The function the execution's state invokes: it settles the record with a V2-ish
    answer naming the request (as the CPU fallback's ``pipeline-respond`` does)."""
    store = AsyncStore(settings, clock=clock)

    def settle(event: dict[str, Any]) -> dict[str, Any]:
        rid = str(event["id"])
        state = store.settle_execution(rid, json_reply(200, {"model_name": "echo", "id": rid}))
        return {"state": state}

    return settle


@pytest.fixture
def stack(
    resources: AsyncSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Stack]:
    clock = Clock()
    states = LocalStepFunctions({MACHINE: _machine({"settle": _settler(resources, clock)})})
    with running(states) as url:
        monkeypatch.setenv("AWS_ENDPOINT_URL_SFN", url)
        yield _stack(resources, clock, states, tmp_path)
    states.close()


# --- the product: one execution per attempt ---------------------------------------------


def test_an_idempotency_key_used_again_after_its_record_expired_runs_again(
    stack: Stack,
) -> None:
    # GIVEN acme's request under key k ran as an execution and was answered
    first = stack.submit("acme", "k")
    assert first.status_code == 202, first.data
    rid = json.loads(first.data)["id"]
    assert stack.finish(rid) == "SUCCEEDED"
    assert stack.result("acme", rid).status_code == 200
    ran = stack.store.find(rid)
    assert ran is not None
    # AND a retry within the record's life is the same request (no second execution)
    again = stack.submit("acme", "k")
    assert (again.status_code, again.headers.get("idempotent-replayed")) == (202, "true")
    assert stack.states.executions() == [ran.execution]
    # WHEN its record has expired (a day later) and acme uses the key again
    stack.clock.now += stack.store.settings.ttl_s + 1
    later = stack.submit("acme", "k")
    # THEN it is a new request, run by a new execution, and answered (it was a 503:
    # the execution name, the request id alone, was still taken)
    assert later.status_code == 202, later.data
    assert later.headers.get("idempotent-replayed") is None
    assert json.loads(later.data)["id"] == rid
    record = stack.store.find(rid)
    assert record is not None
    assert record.execution not in (None, ran.execution)
    assert stack.finish(rid) == "SUCCEEDED"
    answer = stack.result("acme", rid)
    assert answer.status_code == 200, answer.data
    assert json.loads(answer.data) == {"model_name": "echo", "id": rid}
    # AND each execution's name is the request id and its attempt, within Step
    # Functions' 80 characters
    names = [arn.rsplit(":", 1)[-1] for arn in stack.states.executions()]
    assert len(set(names)) == 2
    assert all(name.startswith(rid + "-") for name in names)
    assert all(len(name) <= SFN_EXECUTION_NAME_CHARS for name in names)


class _LoseFirstAnswer:
    """The stand-in, except that the first ``StartExecution`` answer is lost after the
    execution started and ended (a 500, as a dropped connection would be retried)."""

    def __init__(self, states: LocalStepFunctions) -> None:
        self.states = states
        self.lost = 0

    def __call__(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        target = str(environ.get("HTTP_X_AMZ_TARGET", ""))
        if not target.endswith("StartExecution") or self.lost:
            return self.states(environ, start_response)
        self.lost += 1
        answer = b"".join(self.states(environ, lambda *_: None))
        arn = json.loads(answer)["executionArn"]
        self.states.wait(arn, WAIT_S)  # the execution has ended: the name is taken now
        body = json.dumps({"__type": "InternalServerError", "message": "lost"}).encode()
        start_response("500 Internal Server Error", [("content-type", "application/json")])
        return [body]


def test_a_start_whose_answer_was_lost_is_the_execution_it_started(
    resources: AsyncSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN a Step Functions endpoint that loses the first StartExecution's answer, once
    # that execution has run to its end (the router's client retries a 500)
    clock = Clock()
    states = LocalStepFunctions({MACHINE: _machine({"settle": _settler(resources, clock)})})
    lossy = _LoseFirstAnswer(states)
    with running(lossy) as url:
        monkeypatch.setenv("AWS_ENDPOINT_URL_SFN", url)
        stack = _stack(resources, clock, states, tmp_path)
        # WHEN globex submits
        answer = stack.submit("globex", "once")
        # THEN the retried start met ExecutionAlreadyExists for its own attempt: that is
        # the execution it started, not a failure; the one execution's answer is there
        assert lossy.lost == 1
        assert answer.status_code == 202, answer.data
        rid = json.loads(answer.data)["id"]
        assert len(states.executions()) == 1
        result = stack.result("globex", rid)
        assert result.status_code == 200, result.data
        assert json.loads(result.data)["id"] == rid
    states.close()


# --- the stand-in: StartExecution's refusals ---------------------------------------------


@pytest.fixture
def sfn(aws_env: str) -> Iterator[tuple[Any, LocalStepFunctions]]:
    functions = {"settle": lambda event: {"ok": True}}
    # its output is its input (ResultPath null): an input at the limit stays within it
    definition = {"StartAt": "Settle", "States": {"Settle": _task("settle", ResultPath=None)}}
    states = LocalStepFunctions({MACHINE: LocalStateMachine(definition, functions=functions)})
    with running(states) as url:
        yield _sfn(url), states
    states.close()


def _code(call: Callable[[], Any]) -> str:
    with pytest.raises(ClientError) as raised:
        call()
    return str(raised.value.response["Error"]["Code"])


def test_execution_names_are_checked_as_step_functions_checks_them(
    sfn: tuple[Any, LocalStepFunctions],
) -> None:
    client, _ = sfn

    def start(name: str) -> Callable[[], Any]:
        return lambda: client.start_execution(stateMachineArn=MACHINE, name=name, input="{}")

    # GIVEN names at and past 80 characters, and names with forbidden characters
    assert start("n" * SFN_EXECUTION_NAME_CHARS)()["executionArn"].endswith("n" * 80)
    # THEN one character more is a ValidationException
    assert _code(start("n" * (SFN_EXECUTION_NAME_CHARS + 1))) == "ValidationException"
    # AND each forbidden character is InvalidName
    for bad in (" ", "<", "}", "[", "?", "*", '"', "#", "%", "\\", "^", "|", "~", "`", "$",
                "&", ",", ";", ":", "/", "\x01", "\x7f", "\x85"):  # fmt: skip
        assert _code(start(f"a{bad}b")) == "InvalidName", repr(bad)
    # AND the characters CloudWatch logging wants, and more, are fine
    assert start("Az09-_.+=@()!")()["executionArn"].endswith(":Az09-_.+=@()!")


def test_a_name_is_taken_once_its_execution_ended_whatever_the_input(
    sfn: tuple[Any, LocalStepFunctions],
) -> None:
    client, states = sfn
    # GIVEN an execution that ran to its end
    first = '{"id": "1"}'
    arn = client.start_execution(stateMachineArn=MACHINE, name="once", input=first)["executionArn"]
    assert states.wait(arn, WAIT_S).status == "SUCCEEDED"
    # WHEN the name is started again, with the same input or another
    # THEN both are ExecutionAlreadyExists (AWS: for 90 days; here for the stack's life)
    for document in (first, '{"id": "2"}'):
        start = lambda d=document: client.start_execution(  # noqa: E731
            stateMachineArn=MACHINE, name="once", input=d
        )
        assert _code(start) == "ExecutionAlreadyExists"
    assert states.executions() == [arn]


def test_a_running_execution_started_again_with_its_input_is_itself() -> None:
    # GIVEN an execution still running (its state waits for the test)
    import threading

    release = threading.Event()

    def slow(event: dict[str, Any]) -> dict[str, Any]:
        release.wait(WAIT_S)
        return {}

    definition = {"StartAt": "Settle", "States": {"Settle": _task("slow")}}
    states = LocalStepFunctions({MACHINE: LocalStateMachine(definition, functions={"slow": slow})})
    try:
        arn = states.start(MACHINE, "running", '{"id": "1"}')
        # WHEN it is started again with the same input, then with another
        # THEN the first is that execution, the second ExecutionAlreadyExists
        assert states.start(MACHINE, "running", '{"id": "1"}') == arn
        with pytest.raises(Exception, match="Execution Already Exists") as raised:
            states.start(MACHINE, "running", '{"id": "2"}')
        assert getattr(raised.value, "code", None) == "ExecutionAlreadyExists"
    finally:
        release.set()
        states.close()


def test_an_input_past_256_kib_is_refused(sfn: tuple[Any, LocalStepFunctions]) -> None:
    client, states = sfn

    # GIVEN inputs of exactly 262,144 bytes of UTF-8 and one byte more (é is two bytes)
    def document(size: int) -> str:
        room = size - len(json.dumps({"id": "x", "a": ""}))
        filler = "é" * (room // 2) + "x" * (room % 2)
        text = json.dumps({"id": "x", "a": filler}, ensure_ascii=False)
        assert len(text.encode()) == size
        return text

    at_limit = document(SFN_PAYLOAD_BYTES)
    over = document(SFN_PAYLOAD_BYTES + 1)
    # THEN the first starts, the second is a ValidationException
    arn = client.start_execution(stateMachineArn=MACHINE, name="fits", input=at_limit)
    assert states.wait(arn["executionArn"], WAIT_S).status == "SUCCEEDED"
    start = lambda: client.start_execution(  # noqa: E731
        stateMachineArn=MACHINE, name="too-big", input=over
    )
    assert _code(start) == "ValidationException"
    # AND input that is no JSON is InvalidExecutionInput
    bad = lambda: client.start_execution(stateMachineArn=MACHINE, name="bad", input="{")  # noqa: E731
    assert _code(bad) == "InvalidExecutionInput"


def test_a_state_output_past_the_limit_fails_the_execution_uncaught() -> None:
    # GIVEN a state whose task answers more than 256 KiB, with a retrier and a catcher
    # for every error
    catch_all: dict[str, Any] = {
        "Retry": [{"ErrorEquals": ["States.ALL"], "MaxAttempts": 2}],
        "Catch": [{"ErrorEquals": ["States.ALL"], "ResultPath": "$.error", "Next": "Caught"}],
    }
    big = _task("big", **catch_all)
    big["Parameters"]["Payload"]["n.$"] = "$.n"
    definition = {"StartAt": "Big", "States": {"Big": big, "Caught": {"Type": "Succeed"}}}
    machine = LocalStateMachine(
        definition, functions={"big": lambda event: "x" * event["n"]}, sleep=lambda _: None
    )
    # WHEN it answers within the limit, then past it
    fits = machine.run({"id": "a", "n": SFN_PAYLOAD_BYTES - 1000})
    over = machine.run({"id": "b", "n": SFN_PAYLOAD_BYTES})
    # THEN the first succeeds; the second fails with States.DataLimitExceeded, neither
    # retried nor caught (a terminal error: concepts-error-handling)
    assert fits.status == "SUCCEEDED"
    assert (over.status, over.error) == ("FAILED", "States.DataLimitExceeded")
    assert ("Big", "failed States.DataLimitExceeded") in over.history
    assert not any(event.startswith(("retry", "caught")) for _, event in over.history)


def test_a_state_input_past_the_limit_after_parameters_fails_the_execution() -> None:
    # GIVEN a state whose Parameters copy the input twice: within the limit alone,
    # past it together
    doubled = _task("settle")
    doubled["Parameters"] = {"FunctionName": "settle", "Payload": {"a.$": "$.a", "b.$": "$.a"}}
    definition = {"StartAt": "Twice", "States": {"Twice": doubled}}
    machine = LocalStateMachine(definition, functions={"settle": lambda event: {}})
    # WHEN the execution's input is 60 % of the limit
    run = machine.run({"a": "x" * (SFN_PAYLOAD_BYTES * 6 // 10)})
    # THEN the state never ran: States.DataLimitExceeded
    assert (run.status, run.error) == ("FAILED", "States.DataLimitExceeded")
