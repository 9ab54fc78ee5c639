"""The Step Functions form of a pipeline: one Task state per step, written from its
configuration, so the definition never drifts from the pipeline it runs.

``python -m spillway_cli.statemachines --models models topics`` prints the definition
``infra/statemachines/topics.asl.json`` holds; both templates deploy that file (SAM's
``DefinitionUri``, Serverless' ``${file()}``) with the substitutions ``substitutions``
makes: ``${CpuInferFunctionArn}`` (the CPU fallback's alias that the router invokes too,
which runs each state's work: ``spillway.fallback.chain``), ``${ResultsBucket}`` (the
bucket of ``ASYNC_LOCATION``), and ``${LambdaInvoke}`` / ``${S3PutObject}``, the service
integrations' ARNs in the stack's partition (no ARN in the file names ``aws``; a whole
value substituted, so cfn-lint's partition-pinned ARN pattern still checks the rest).

The router starts an execution for an async request of the pipeline
(``spillway.router.async_mode``; ``ASYNC_STATE_MACHINES`` names the machine), named by
the request id and its attempt (``spillway.async_inference.records.execution_name``), with
the input ``{"id": "<request id>", "tenant_scope": "<its caller's scope>", "trace":
{"traceparent", "tracestate"}}``; the request's async record says where its body is.
Every state passes the execution's input on (``execution``), so each step's Lambda
continues the request's trace. Each step state runs that step (``pipeline-step``,
the step cache scoped to that tenant), ``Respond`` settles the record with the V2
response. A step that fails for the service's reasons (``ServerFault``, Lambda throttling
or service errors) is retried with backoff; any failure left is caught and
``SettleFailure`` settles the record with its error (``pipeline-failed``); only when that
too fails is it written to ``async/<id>/error.json`` (``{"Error", "Cause"}``). A failed
execution ends as ``PipelineFailed``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spillway.models.repository import LocalRepository
from spillway.pipelines.chain import FAILED, RESPOND, STEP
from spillway.pipelines.definition import Pipeline
from spillway.pipelines.graph import read_pipeline

ROOT = Path(__file__).resolve().parents[1]
FUNCTION = "${CpuInferFunctionArn}"
BUCKET = "${ResultsBucket}"
LAMBDA_INVOKE = "${LambdaInvoke}"
S3_PUT_OBJECT = "${S3PutObject}"
INTEGRATIONS = {"LambdaInvoke": "lambda:invoke", "S3PutObject": "aws-sdk:s3:putObject"}
"""The service integrations the definition uses, by substitution."""
PREFIX = "async"
"""Where ``ASYNC_LOCATION`` points in ``${ResultsBucket}``."""
SUBSTITUTIONS = ("CpuInferFunctionArn", "ResultsBucket", *INTEGRATIONS)
TENANT = {"tenant_scope.$": "$.tenant_scope"}
"""Every call carries the execution's tenant scope (its cache entries, its record)."""
EXECUTION = {"execution.$": "$$.Execution.Input"}
"""Every call carries the execution's input, whose ``trace`` its Lambda continues: the
context object's input is there whatever the states added, and a path to a field the
input may lack (``$.trace``) would fail the state with ``States.Runtime``
(https://docs.aws.amazon.com/step-functions/latest/dg/input-output-contextobject.html)."""
RETRIED = [
    "ServerFault",
    "Lambda.ServiceException",
    "Lambda.AWSLambdaException",
    "Lambda.SdkClientException",
    "Lambda.TooManyRequestsException",
]
_RETRY = {"ErrorEquals": RETRIED, "IntervalSeconds": 2, "MaxAttempts": 3, "BackoffRate": 2.0}
_CATCH = [{"ErrorEquals": ["States.ALL"], "ResultPath": "$.error", "Next": "SettleFailure"}]


def substitutions(function: str, bucket: str, partition: str = "aws") -> dict[str, str]:
    """The values the templates substitute (``arn:${AWS::Partition}:states:::…`` for each
    integration), for the local interpreter and the tests."""
    arns = {key: f"arn:{partition}:states:::{name}" for key, name in INTEGRATIONS.items()}
    return {"CpuInferFunctionArn": function, "ResultsBucket": bucket, **arns}


def definition_path(name: str) -> Path:
    """Where a pipeline's definition is kept in the repository."""
    return ROOT / "infra" / "statemachines" / f"{name}.asl.json"


def _invoke(
    payload: dict[str, Any],
    selector: dict[str, str],
    result: str,
    then: str,
    catch: list[dict[str, Any]] = _CATCH,
) -> dict[str, Any]:
    return {
        "Type": "Task",
        "Resource": LAMBDA_INVOKE,
        "Parameters": {"FunctionName": FUNCTION, "Payload": {**payload, **TENANT, **EXECUTION}},
        "ResultSelector": selector,
        "ResultPath": result,
        "Retry": [_RETRY],
        "Catch": catch,
        "Next": then,
    }


def chain_definition(pipeline: Pipeline) -> dict[str, Any]:
    """The Amazon States Language definition of ``pipeline``'s Step Functions form."""
    names = [f"Step{k}-{step.model}" for k, step in enumerate(pipeline.steps)]
    states: dict[str, Any] = {}
    for k, name in enumerate(names):
        payload = {"spillway": STEP, "pipeline": pipeline.name, "step": k, "id.$": "$.id"}
        selector = {"state.$": "$.Payload.state", "skipped.$": "$.Payload.skipped"}
        then = names[k + 1] if k + 1 < len(names) else "Respond"
        states[name] = _invoke(payload, selector, f"$.step{k}", then)
    respond = {"spillway": RESPOND, "pipeline": pipeline.name, "id.$": "$.id"}
    selector = {"result.$": "$.Payload.result", "version.$": "$.Payload.version"}
    states["Respond"] = _invoke(respond, selector, "$.response", "Done")
    states["Done"] = {"Type": "Succeed"}
    failed = {"spillway": FAILED, "pipeline": pipeline.name, "id.$": "$.id", "error.$": "$.error"}
    last_resort = [
        {"ErrorEquals": ["States.ALL"], "ResultPath": "$.settling", "Next": "RecordError"}
    ]
    selector = {"state.$": "$.Payload.state", "status.$": "$.Payload.status"}
    states["SettleFailure"] = _invoke(failed, selector, "$.settled", "Failed", last_resort)
    states["RecordError"] = {
        "Type": "Task",
        "Resource": S3_PUT_OBJECT,
        "Parameters": {
            "Bucket": BUCKET,
            "Key.$": f"States.Format('{PREFIX}/{{}}/error.json', $.id)",
            "Body.$": "States.JsonToString($.error)",
            "ContentType": "application/json",
        },
        "ResultPath": None,
        "Retry": [{"ErrorEquals": ["States.ALL"], "IntervalSeconds": 1, "MaxAttempts": 2}],
        "Next": "Failed",
    }
    states["Failed"] = {
        "Type": "Fail",
        "Error": "PipelineFailed",
        "Cause": f"the error is in the request's async record (or {PREFIX}/<id>/error.json)",
    }
    return {
        "Comment": f"The {pipeline.name} pipeline, one state per step (spillway_cli.statemachines)",
        "StartAt": names[0],
        "States": states,
    }


def render(definition: dict[str, Any]) -> str:
    """The definition as the file holds it."""
    return json.dumps(definition, indent=2) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--models", type=Path, default=Path("models"), help="repository")
    parser.add_argument("pipeline", help="a pipeline of the repository (e.g. topics)")
    args = parser.parse_args(argv)
    repository = LocalRepository(args.models)
    pipeline = read_pipeline(repository, repository.read_config(args.pipeline))
    print(render(chain_definition(pipeline)), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
