"""The Step Functions form of ``topics``: the checked-in definition is the one its
configuration makes, both templates deploy it, no ARN in it names a partition, every
state carries the execution's tenant scope, and the local interpreter runs its retries,
its catch and the settling of a failure as Step Functions would."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.checks.cfn_eval import load_cfn
from spillway.pipelines.graph import build_pipeline
from spillway_cli.local.states import DefinitionError, LocalStateMachine, substituted
from spillway_cli.modelbuild.minilm import minilm_config
from spillway_cli.modelbuild.topics import head_config, topics_config
from spillway_cli.statemachines import (
    SUBSTITUTIONS,
    chain_definition,
    definition_path,
    render,
    substitutions,
)

ROOT = Path(__file__).resolve().parents[2]
FUNCTION = "arn:aws:lambda:us-east-1:123456789012:function:cpu:live"
REQUEST_ID = "0123456789abcdef0123456789abcdef"
SCOPE = "fedcba9876543210fedcba9876543210"
PARTITIONS = ("aws", "aws-cn", "aws-us-gov")


def topics_definition() -> dict[str, Any]:
    configs = {c.name: c for c in (minilm_config(), head_config())}
    pipeline = build_pipeline(topics_config(), configs, {name: [1] for name in configs})
    return chain_definition(pipeline)


def local_definition(partition: str = "aws") -> dict[str, Any]:
    checked_in = json.loads(definition_path("topics").read_text())
    return substituted(checked_in, substitutions(FUNCTION, "data", partition))


def test_the_checked_in_definition_is_the_one_the_pipeline_makes() -> None:
    # (python -m spillway_cli.statemachines --models models topics rewrites it)
    assert definition_path("topics").read_text() == render(topics_definition())


def test_both_templates_deploy_that_definition() -> None:
    sam = load_cfn(ROOT / "template.yaml")["Resources"]
    machines = [
        r["Properties"] for r in sam.values() if r["Type"] == "AWS::Serverless::StateMachine"
    ]
    assert [m["DefinitionUri"] for m in machines] == ["infra/statemachines/topics.asl.json"]
    assert set(machines[0]["DefinitionSubstitutions"]) == set(SUBSTITUTIONS)
    sls = yaml.safe_load((ROOT / "infra/serverless-resources.yml").read_text())
    machines = [
        r["Properties"] for r in sls.values() if r["Type"] == "AWS::StepFunctions::StateMachine"
    ]
    assert [m["Definition"] for m in machines] == ["${file(infra/statemachines/topics.asl.json)}"]
    assert set(machines[0]["DefinitionSubstitutions"]) == set(SUBSTITUTIONS)


class Steps:
    """The CPU function's side: fails with the given exceptions first, then answers."""

    def __init__(self, failures: dict[str, list[Exception]] | None = None) -> None:
        self.failures = failures or {}
        self.calls: list[dict[str, Any]] = []

    def __call__(self, event: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(event)
        label = f"{event['spillway']}:{event.get('step', '')}"
        pending = self.failures.get(label, [])
        if pending:
            raise pending.pop(0)
        if event["spillway"] == "pipeline-respond":
            return {"result": f"s3://data/async/{event['id']}/result", "version": "1"}
        if event["spillway"] == "pipeline-failed":
            return {"state": "failed", "status": 400}
        return {"state": f"s3://data/async/{event['id']}/steps/{event['step']}", "skipped": False}


class ServerFault(Exception):  # the names are what the definition's retriers match
    pass


class ClientFault(Exception):
    pass


class FakeS3:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], bytes] = {}

    def put_object(self, *, Bucket: str, Key: str, Body: bytes, **_: Any) -> dict[str, Any]:
        self.objects[Bucket, Key] = Body
        return {"ETag": '"0"'}


def run(steps: Steps, s3: FakeS3 | None = None) -> tuple[Any, list[float]]:
    waits: list[float] = []
    machine = LocalStateMachine(
        local_definition(), functions={FUNCTION: steps}, s3=s3, sleep=waits.append
    )
    return machine.run({"id": REQUEST_ID, "tenant_scope": SCOPE}), waits


def test_each_step_then_the_response_run_in_order() -> None:
    steps = Steps()
    execution, waits = run(steps)
    assert execution.status == "SUCCEEDED"
    assert [(c["spillway"], c.get("step")) for c in steps.calls] == [
        ("pipeline-step", 0),
        ("pipeline-step", 1),
        ("pipeline-respond", None),
    ]
    assert {c["id"] for c in steps.calls} == {REQUEST_ID}
    assert {c["tenant_scope"] for c in steps.calls} == {SCOPE}
    assert execution.output["response"] == {
        "result": f"s3://data/async/{REQUEST_ID}/result",
        "version": "1",
    }
    assert execution.output["step1"]["state"].endswith("/steps/1")
    assert waits == []


def test_a_server_fault_is_retried_with_backoff() -> None:
    steps = Steps({"pipeline-step:1": [ServerFault("busy"), ServerFault("busy")]})
    execution, waits = run(steps)
    assert execution.status == "SUCCEEDED"
    assert waits == [2.0, 4.0]
    assert ("Step1-topics-head", "retry 2 after ServerFault") in execution.history


def test_a_client_fault_is_not_retried_and_settles_the_record_as_failed() -> None:
    # GIVEN a step whose request is at fault
    body = {"status": 400, "code": "invalid_input", "error": "text must not be empty"}
    steps = Steps({"pipeline-step:0": [ClientFault(json.dumps(body))]})
    s3 = FakeS3()
    # WHEN the machine runs
    execution, waits = run(steps, s3)
    # THEN no retry; the catch hands the error to the CPU function, which settles the
    # request's record with it; the execution failed and no error object was needed
    assert waits == []
    assert (execution.status, execution.error) == ("FAILED", "PipelineFailed")
    assert [c["spillway"] for c in steps.calls] == ["pipeline-step", "pipeline-failed"]
    settled = steps.calls[-1]
    assert (settled["id"], settled["tenant_scope"]) == (REQUEST_ID, SCOPE)
    assert settled["error"]["Error"] == "ClientFault"
    assert json.loads(json.loads(settled["error"]["Cause"])["errorMessage"]) == body
    assert s3.objects == {}


def test_retries_end_and_the_failure_is_caught() -> None:
    steps = Steps({"pipeline-respond:": [ServerFault("down")] * 4})
    s3 = FakeS3()
    execution, waits = run(steps, s3)
    assert waits == [2.0, 4.0, 8.0]
    assert execution.status == "FAILED"
    assert ("Respond", "caught ServerFault") in execution.history
    assert steps.calls[-1]["error"]["Error"] == "ServerFault"
    assert ("SettleFailure", "succeeded") not in execution.history


def test_when_the_failure_cannot_be_settled_it_lands_in_the_error_object() -> None:
    # GIVEN a failing step, and a CPU function that cannot settle it either (it is down)
    steps = Steps(
        {
            "pipeline-step:0": [ServerFault("down")] * 4,
            "pipeline-failed:": [ServerFault("down")] * 4,
        }
    )
    s3 = FakeS3()
    execution, _ = run(steps, s3)
    # THEN the last resort wrote the step's error where an operator finds it
    assert execution.status == "FAILED"
    assert ("SettleFailure", "caught ServerFault") in execution.history
    record = json.loads(s3.objects["data", f"async/{REQUEST_ID}/error.json"])
    assert record["Error"] == "ServerFault"


def test_the_checked_in_definition_names_no_partition() -> None:
    text = definition_path("topics").read_text()
    # THEN no ARN is written in it: each integration is substituted in the stack's
    # partition (aws-cn, aws-us-gov deploy it too)
    assert "arn:" not in text
    tasks = [s for s in json.loads(text)["States"].values() if s["Type"] == "Task"]
    assert {t["Resource"] for t in tasks} == {"${LambdaInvoke}", "${S3PutObject}"}
    assert len(tasks) == 5


@pytest.mark.parametrize("partition", PARTITIONS)
def test_the_definition_runs_in_every_partition(partition: str) -> None:
    # GIVEN the definition as CloudFormation substitutes it in that partition
    definition = local_definition(partition)
    resources = {s["Resource"] for s in definition["States"].values() if "Resource" in s}
    # THEN its integrations are that partition's, and they run
    assert {r.split(":")[1] for r in resources} == {partition}
    steps = Steps()
    machine = LocalStateMachine(definition, functions={FUNCTION: steps}, sleep=lambda _: None)
    assert machine.run({"id": REQUEST_ID, "tenant_scope": SCOPE}).status == "SUCCEEDED"
    assert len(steps.calls) == 3


def test_what_the_interpreter_does_not_run_is_refused_at_load() -> None:
    definition = local_definition()
    definition["States"]["Done"] = {"Type": "Map", "Iterator": {}}
    with pytest.raises(DefinitionError, match="Map"):
        LocalStateMachine(definition, functions={})
    with pytest.raises(DefinitionError, match="substitution is left unset"):
        substituted(json.loads(definition_path("topics").read_text()), {"ResultsBucket": "x"})
    with pytest.raises(DefinitionError, match="resource"):
        LocalStateMachine(local_definition("aws-xx"), functions={})
