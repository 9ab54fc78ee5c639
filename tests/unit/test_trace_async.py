"""One trace across the hops that are not a synchronous call: the async record keeps the
carrier of the span it was accepted in (only a well-formed one), a worker's run is a
``spillway.async.run`` span of it (two tenants, two traces), an execution's input and
each state's call carry it, and a batch submission passes it to the jobs API and into
the Batch job's environment. With tracing off, a client's carrier is still passed on."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry.trace import SpanKind, StatusCode

from batch_job import api as jobs_api
from batch_job.service import JobService
from batch_job.settings import JobsSettings
from spillway import tracing
from spillway.async_inference.queue import Message
from spillway.async_inference.records import AsyncRecord, from_item, to_item
from spillway.async_inference.settings import AsyncSettings
from spillway.async_inference.store import AsyncStore, Job
from spillway.async_inference.traced import RUN_SPAN, running
from spillway.fallback.async_drain import run_message
from spillway.pipelines.chain import ChainEvent
from spillway.policy.backend import BackendRequest
from spillway.protocol.errors import InferenceError
from spillway.protocol.messages import JobRequest, JobView, SubmitReceipt
from spillway.router.batch_mode import JobsApiSubmitter
from spillway.state import dynamo
from spillway.state.table import scope
from spillway_cli.local.states import LocalStateMachine
from tests.unit.test_pipeline_statemachine import FUNCTION, REQUEST_ID, SCOPE, Steps
from tests.unit.test_pipeline_statemachine import local_definition as topics_machine
from tests.unit.test_router_staging import STAGING, JobsApi, MemoryS3
from tests.unit.test_trace_async_fixtures import (
    CLIENT_A,
    CLIENT_B,
    PARENT_A,
    PARENT_B,
    TRACE_A,
    TRACE_B,
    Spans,
    attrs,
    hex_ids,
    spans_fixture,  # noqa: F401 - ``spans``
    tracing_off_fixture,  # noqa: F401 - ``tracing_off``
)

SETTINGS = AsyncSettings(
    table="async", queue_url="http://127.0.0.1/q", location="s3://data/async", lease_s=30
)


def _record(tenant: str, trace: Any = None, rid: str = "0" * 31 + "1") -> AsyncRecord:
    return AsyncRecord(
        id=rid, tenant=tenant, scope=scope(tenant), model="digits", state="running",
        created_at=100.0, updated_at=100.25, expires_at=200, input="s3://data/async/x",
        output="s3://data/async/x/", attempts=2, trace=trace,
    )  # fmt: skip


# --- the record --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hostile",
    [
        "00-" + "a" * 32 + "-" + "b" * 16 + "-01",  # a string, not an object
        42,
        ["traceparent"],
        {"traceparent": 7},
        {"traceparent": "garbage", "tracestate": "x=1"},
        {"traceparent": "00-" + "0" * 32 + "-" + "b" * 16 + "-01"},  # the invalid trace id
        {"traceparent": "01-" + "a" * 32 + "-" + "b" * 16 + "-01-extra"},
        {"tracestate": "x=1"},
    ],
)
def test_a_malformed_trace_in_a_record_is_ignored(hostile: Any) -> None:
    # GIVEN a record item whose trace attribute is not a carrier
    item = {**to_item(_record("alice")), "trace": dynamo.item({"t": hostile})["t"]}
    # WHEN it is read (or a record is made with it)
    # THEN it has no trace, and no error
    assert from_item(item).trace is None
    assert _record("alice", hostile).trace is None
    # AND a well-formed one survives the item's round trip
    assert from_item(to_item(_record("alice", CLIENT_A))).trace == CLIENT_A


def test_only_the_validated_carrier_is_kept() -> None:
    # GIVEN a carrier with a tracestate past W3C's 512 characters and an extra key
    given = {**CLIENT_B, "tracestate": "k=" + "v" * 600, "baggage": "secret=1"}
    # WHEN a record is made with it and read back from its item
    record = from_item(to_item(_record("bob", given)))
    # THEN the traceparent alone is kept
    assert record.trace == {"traceparent": CLIENT_B["traceparent"]}
    assert _record("alice", CLIENT_A).trace == CLIENT_A


# --- Step Functions ----------------------------------------------------------------------


@dataclass
class StepFunctions:
    starts: list[dict[str, Any]] = field(default_factory=list)

    def start_execution(self, **kwargs: Any) -> dict[str, Any]:
        self.starts.append(kwargs)
        return {"executionArn": "arn"}


def test_an_execution_input_carries_its_records_trace() -> None:
    # GIVEN two tenants' execution-run records, alice's traced and bob's not
    states = StepFunctions()
    store = AsyncStore(SETTINGS, clients=lambda service: states)
    arn = "arn:aws:states:us-east-1:123456789012:execution:topics:x-1"
    alice = _record("alice", CLIENT_A).model_copy(update={"execution": arn})
    bob = _record("bob").model_copy(update={"execution": arn.replace("x-1", "y-1")})
    # WHEN their executions start
    machine = "arn:aws:states:us-east-1:123456789012:stateMachine:topics"
    store.start_execution(alice, machine)
    store.start_execution(bob, machine)
    # THEN each input holds its own record's carrier, ``{}`` for none (so that the
    # states' paths always resolve)
    inputs = [json.loads(s["input"]) for s in states.starts]
    assert inputs == [
        {"id": alice.id, "tenant_scope": scope("alice"), "trace": CLIENT_A},
        {"id": bob.id, "tenant_scope": scope("bob"), "trace": {}},
    ]


def test_every_state_passes_the_execution_input_on() -> None:
    # GIVEN the checked-in topics definition and an execution input with a trace
    steps = Steps()
    machine = LocalStateMachine(topics_machine(), functions={FUNCTION: steps}, sleep=lambda _: None)
    document = {"id": REQUEST_ID, "tenant_scope": SCOPE, "trace": CLIENT_A}
    # WHEN it runs
    assert machine.run(document).status == "SUCCEEDED"
    # THEN every call carries the input, and its event reads the trace from it
    assert [c["execution"] for c in steps.calls] == [document] * 3
    assert {json.dumps(ChainEvent.model_validate(c).trace()) for c in steps.calls} == {
        json.dumps(CLIENT_A)
    }
    # AND an execution started without a trace still runs (its events carry none)
    old = Steps()
    machine = LocalStateMachine(topics_machine(), functions={FUNCTION: old}, sleep=lambda _: None)
    assert machine.run({"id": REQUEST_ID, "tenant_scope": SCOPE}).status == "SUCCEEDED"
    assert [ChainEvent.model_validate(c).trace() for c in old.calls] == [{}, {}, {}]


@pytest.mark.parametrize(
    "execution",
    [None, "x", [1], {"trace": "00-x"}, {"trace": {"traceparent": 1}}, {"trace": [CLIENT_A]}],
)
def test_a_malformed_execution_input_is_no_trace_and_no_error(execution: Any) -> None:
    event = {"spillway": "pipeline-step", "pipeline": "topics", "id": REQUEST_ID, "step": 0,
             "tenant_scope": SCOPE, "execution": execution}  # fmt: skip
    assert ChainEvent.model_validate(event).trace() == {}


# --- the workers -------------------------------------------------------------------------


@dataclass
class RecordedStore:
    """The store's consumer side for ``run_message``: claims hand out the records given."""

    records: dict[str, AsyncRecord]
    settled: dict[str, int] = field(default_factory=dict)

    def claim(self, message: Message, owner: str) -> Job | None:
        return Job(self.records[message.id], message, "token")

    def read_input(self, job: Job) -> tuple[bytes, int | None]:
        return b'{"inputs": []}', None

    def settle(self, job: Job, reply: Any) -> str | None:
        self.settled[job.record.id] = reply.status
        return "succeeded" if reply.status == 200 else None


@dataclass
class Answer:
    body: bytes = b'{"outputs": []}'
    header_length: int | None = None
    version: str = "1"


class TracedService:
    """The CPU service's ``infer``: its own span (as the engine's), or a failure."""

    def __init__(self, fail_for: str | None = None) -> None:
        self.fail_for = fail_for
        self.seen: list[str | None] = []

    def infer(self, model: str, version: Any, body: bytes, length: Any, **kw: Any) -> Answer:
        with tracing.span("engine"):
            self.seen.append(tracing.trace_id())
            if kw.get("stored_scope") == self.fail_for:
                raise InferenceError("the engine failed")
            return Answer()


def test_each_tenants_run_is_a_span_of_its_own_requests_trace(spans: Spans) -> None:
    # GIVEN alice's and bob's requests, accepted in two different traces
    alice = _record("alice", CLIENT_A, "a" * 32)
    bob = _record("bob", CLIENT_B, "b" * 32)
    store = RecordedStore({alice.id: alice, bob.id: bob})
    service = TracedService(fail_for=scope("bob"))
    # WHEN the CPU worker runs both deliveries (bob's fails on the engine)
    for rid in (alice.id, bob.id):
        run_message(service, store, Message(rid, "r", 2, ""))  # type: ignore[arg-type]
    # THEN each run is a consumer span whose parent is its own request's span
    runs = {attrs(s)["spillway.request_id"]: s for s in spans.named(RUN_SPAN)}
    assert set(runs) == {alice.id, bob.id}
    assert hex_ids(runs[alice.id])[::2] == (TRACE_A, PARENT_A)
    assert hex_ids(runs[bob.id])[::2] == (TRACE_B, PARENT_B)
    assert runs[alice.id].kind == SpanKind.CONSUMER
    assert dict(attrs(runs[alice.id])) == {
        "spillway.model": "digits", "spillway.tenant_scope": scope("alice"),
        "spillway.request_id": alice.id, "spillway.attempt": 2, "spillway.queue_wait_ms": 250,
        "spillway.worker": "cpu", "spillway.async.state": "succeeded",
        "http.response.status_code": 200,
    }  # fmt: skip
    # AND the engine's spans are the runs' children, in the runs' traces
    assert service.seen == [TRACE_A, TRACE_B]
    engines = {hex_ids(s)[0]: hex_ids(s)[2] for s in spans.named("engine")}
    assert engines == {TRACE_A: hex_ids(runs[alice.id])[1], TRACE_B: hex_ids(runs[bob.id])[1]}
    # AND bob's failed run says so, and that it will be retried
    assert runs[bob.id].status.status_code == StatusCode.ERROR
    assert attrs(runs[bob.id])["spillway.async.state"] == "retry"
    assert attrs(runs[bob.id])["spillway.error_code"] == "inference_failed"
    assert store.settled == {alice.id: 200, bob.id: 500}


def test_a_record_without_a_trace_runs_in_a_new_one(spans: Spans) -> None:
    record = _record("alice")
    run_message(TracedService(), RecordedStore({record.id: record}), Message(record.id, "r", 1))  # type: ignore[arg-type]
    (run,) = spans.named(RUN_SPAN)
    assert run.parent is None
    assert hex_ids(run)[0] not in (TRACE_A, TRACE_B)


@pytest.mark.usefixtures("tracing_off")
def test_with_tracing_off_the_records_carrier_is_passed_on_as_it_came() -> None:
    # GIVEN a process that records no spans, and two tenants' records
    for tenant, client in (("alice", CLIENT_A), ("bob", CLIENT_B)):
        record = _record(tenant, client)
        # WHEN a worker runs one
        with running(record, "gpu") as span:
            # THEN what it sends on is the client's carrier, unchanged
            assert tracing.outgoing() == client
            assert tracing.trace_id() == client["traceparent"][3:35]
            assert span is tracing.NO_SPAN
    assert tracing.outgoing() == {}


# --- batch jobs --------------------------------------------------------------------------


def test_a_batch_submission_passes_the_attempts_trace_to_the_jobs_api() -> None:
    # GIVEN the router's batch submitter, and two tenants' attempts (bob's untraced)
    api = JobsApi()
    submitter = JobsApiSubmitter(api, STAGING, s3=MemoryS3())
    for tenant, carrier in (("alice", CLIENT_A), ("bob", {})):
        headers = {"content-type": "application/json", **carrier}
        request = BackendRequest(
            "POST", "/v2/models/digits/infer", "infer", model="digits",
            headers=headers, body=b'{"inputs": []}', tenant=tenant,
        )  # fmt: skip
        # WHEN each is submitted
        submitter.submit(request, 1.0)
    # THEN the POST of alice's carries her carrier, bob's none
    sent = [{k: v for k, v in p.headers.items() if k in tracing.CARRIER_KEYS} for p in api.posts]
    assert sent == [CLIENT_A, {}]


@dataclass
class Batch:
    submitted: list[dict[str, Any]] = field(default_factory=list)

    def submit_job(self, **kwargs: Any) -> dict[str, Any]:
        self.submitted.append(kwargs)
        return {"jobId": "j-1", "jobName": kwargs["jobName"]}


def _submit_env(carrier: dict[str, str]) -> dict[str, str]:
    batch = Batch()
    service = JobService(JobsSettings(), client=lambda name: batch)
    request = JobRequest(model="digits", input="s3://data/in/", output="s3://data/out/")
    plan = SimpleNamespace(model="digits", model_version=1)  # what a submission reads of it
    with tracing.carry(carrier):
        service._submit_batch("0" * 8, scope("alice"), request, plan, 1)  # type: ignore[arg-type]
    environment = batch.submitted[0]["containerOverrides"]["environment"]
    return {e["name"]: e["value"] for e in environment}


def test_the_batch_job_environment_carries_the_submitting_trace(spans: Spans) -> None:
    # GIVEN tracing on and a submission inside alice's trace
    env = _submit_env(CLIENT_A)
    # THEN the job's TRACEPARENT is in her trace (the current span: the client's here)
    assert env["TRACEPARENT"] == CLIENT_A["traceparent"]
    assert env["TRACESTATE"] == CLIENT_A["tracestate"]
    # AND a submission in no trace sets neither
    assert set(_submit_env({})) == {"JOBS_ARRAY_SIZE", "JOBS_TENANT_SCOPE"}


@pytest.mark.usefixtures("tracing_off")
def test_with_tracing_off_the_batch_job_still_gets_the_clients_carrier() -> None:
    env = _submit_env(CLIENT_B)
    assert (env["TRACEPARENT"], "TRACESTATE" in env) == (CLIENT_B["traceparent"], False)


class CapturingJobs:
    """``Jobs`` for ``dispatch``: records the trace current at submission."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []

    def submit(self, request: JobRequest, key: str | None = None, *, tenant: str | None) -> Any:
        self.seen.append(tracing.outgoing())
        view = JobView(job_id="0" * 8 + "-0000-0000-0000-" + "0" * 12, state="SUBMITTED",
                       model="digits", input=request.input, output=request.output,
                       created_at="2026-12-01T00:00:00+00:00")  # fmt: skip
        return SubmitReceipt(job=view, replayed=False)

    def status(self, job_id: str, *, tenant: str | None) -> Any:
        raise AssertionError("not asked")


def test_the_jobs_api_continues_the_requests_trace(spans: Spans) -> None:
    # GIVEN POST /v1/jobs events of two tenants, each with its own traceparent header
    jobs = CapturingJobs()
    body = JobRequest(model="digits", input="s3://data/in/", output="s3://data/out/")
    for tenant, carrier in (("alice", CLIENT_A), ("bob", CLIENT_B)):
        event = {"httpMethod": "POST", "path": "/v1/jobs", "body": body.model_dump_json(),
                 "headers": {"Traceparent": carrier["traceparent"]},
                 "requestContext": {"authorizer": {"tenant": tenant}}}  # fmt: skip
        # WHEN the jobs API answers it
        assert jobs_api.dispatch(event, jobs)["statusCode"] == 202
    # THEN the submission ran in a ``spillway.jobs`` span of the request's trace
    served = spans.named("spillway.jobs")
    assert [hex_ids(s)[::2] for s in served] == [(TRACE_A, PARENT_A), (TRACE_B, PARENT_B)]
    # AND what it passed on (to the Batch job) names that span
    passed = [s["traceparent"].split("-")[1:3] for s in jobs.seen]
    assert passed == [list(hex_ids(s)[:2]) for s in served]


def test_the_job_reads_its_trace_from_its_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACEPARENT", CLIENT_A["traceparent"])
    monkeypatch.setenv("TRACESTATE", CLIENT_A["tracestate"])
    assert JobsSettings().trace() == CLIENT_A
    monkeypatch.setenv("TRACEPARENT", "00-not-a-trace")
    monkeypatch.setenv("TRACESTATE", "x" * 5000)
    assert JobsSettings().trace() == {}


def test_the_runner_makes_a_span_per_shard(spans: Spans, tmp_path: Path) -> None:
    from tests.unit.test_jobs_runner import _inputs, _runner

    # GIVEN two shards, run inside a job span of alice's trace
    _inputs(tmp_path / "in", shards=2)
    runner = _runner(tmp_path)
    with tracing.carry(CLIENT_A), tracing.span("spillway.batch.job"):
        result = runner.run(list(runner.plan.shards))
    assert result.committed == ["part-00000", "part-00001"]
    # THEN each shard is a span of the job's, with its counts
    (job,) = spans.named("spillway.batch.job")
    shards = spans.named("spillway.batch.shard")
    assert [attrs(s)["spillway.batch.shard"] for s in shards] == ["part-00000", "part-00001"]
    assert {hex_ids(s)[0] for s in shards} == {TRACE_A}
    assert {hex_ids(s)[2] for s in shards} == {hex_ids(job)[1]}
    assert [attrs(s)["spillway.batch.records"] for s in shards] == [7, 7]
