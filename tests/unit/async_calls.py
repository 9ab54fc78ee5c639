"""Async inference as deployed: each component's ``ASYNC_*`` environment, and the AWS
calls its code makes, recorded from the code itself.

The environment comes from the stacks resolved as CloudFormation would
(``tests.unit.stacks``): the router's and the CPU function's variables in each
application template, the GPU task's container definition. The calls come from running
the real code — ``AsyncStore`` on the router's side (submit, results), the consumers' side
(receive, claim, read, settle: success, retry, the last failed delivery to the DLQ), the
CPU function's SQS batch handler and drain check — with each component's settings against
the storage stack's table, queues and bucket created in moto (in-process, from the
template's own properties: key schema, index, visibility timeout, redrive policy). A
botocore hook notes every call with the ARN IAM authorises it on, plus the KMS calls
S3 and SQS make with the caller's credentials on the storage key (SSE-KMS). Lambda's
control API is a fake that answers as Lambda would for the template's event source
mapping (listed by function name and queue).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any
from unittest import mock

from infra.checks.cfn_eval import Stack, arn
from spillway.async_inference.queue import message_of
from spillway.async_inference.settings import AsyncSettings
from spillway.async_inference.store import AsyncStore
from spillway.protocol.errors import InferenceError
from spillway.protocol.replies import error_reply, infer_reply
from spillway.state.table import scope
from tests.unit.stacks import Deployment, serverless_config

REGION = "us-east-1"
RESULT = json.dumps({"model_name": "digits", "outputs": []}).encode()
BODY = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]})
ANY = "*"


@dataclass(frozen=True)
class Call:
    """An IAM action on the ARN it is authorised against."""

    action: str
    resource: str


# --- the environment of each component ---------------------------------------------------


def _strings(variables: Mapping[str, Any]) -> dict[str, str]:
    return {name: str(value) for name, value in variables.items()}


def sam_function_env(stack: Stack, function: str) -> dict[str, str]:
    """A SAM function's variables as deployed (``Globals`` merged under its own)."""
    shared = stack.resolve(stack.template["Globals"]["Function"]["Environment"]["Variables"])
    own = stack.properties(function)["Environment"]["Variables"]
    return _strings({**shared, **own})


def sls_function_env(
    stack: Stack, key: str, cli: Mapping[str, Any] | None = None
) -> dict[str, str]:
    """A Serverless function's variables for stage prod (provider's under its own)."""
    config = serverless_config(cli)
    variables = {**config["provider"]["environment"], **config["functions"][key]["environment"]}
    return _strings(stack.resolve(variables))


def gpu_task_env(stack: Stack) -> dict[str, str]:
    """The GPU service container's variables as deployed."""
    task = stack.properties("TaskDefinition")
    container = next(c for c in task["ContainerDefinitions"] if c["Name"] == "gpu-service")
    return _strings({entry["Name"]: entry["Value"] for entry in container["Environment"]})


@dataclass(frozen=True)
class Application:
    """One deployed application template (``label``: sam, serverless, packaged): its
    stack, the CPU function's logical ID, and the environments of the router and the CPU
    function."""

    label: str
    stack: Stack
    cpu_function: str
    router_env: dict[str, str]
    cpu_env: dict[str, str]


def sam_application(stack: Stack) -> Application:
    """template.yaml deployed as ``stack``."""
    return Application(
        "sam",
        stack,
        "CpuInferFunction",
        sam_function_env(stack, "RouterFunction"),
        sam_function_env(stack, "CpuInferFunction"),
    )


def sls_application(stack: Stack, cli: Mapping[str, Any] | None = None) -> Application:
    """serverless.yml for stage prod (with ``--param`` values ``cli``) deployed as ``stack``."""
    return Application(
        "serverless",
        stack,
        "CpuInferLambdaFunction",
        sls_function_env(stack, "router", cli),
        sls_function_env(stack, "cpuInfer", cli),
    )


def applications(d: Deployment) -> list[Application]:
    """The SAM and Serverless applications (and the packaged one, when present)."""
    found = [sam_application(d.sam), sls_application(d.sls)]
    if d.packaged is not None:
        env = {
            logical: _strings(d.packaged.properties(logical)["Environment"]["Variables"])
            for logical in ("RouterLambdaFunction", "CpuInferLambdaFunction")
        }
        found.append(
            Application(
                "packaged",
                d.packaged,
                "CpuInferLambdaFunction",
                env["RouterLambdaFunction"],
                env["CpuInferLambdaFunction"],
            )
        )
    return found


# --- recording the calls -----------------------------------------------------------------


def _object(bucket: str, key: str) -> str:
    return f"arn:aws:s3:::{bucket}/{key}"


def iam_calls(service: str, operation: str, params: Mapping[str, Any], key: str) -> list[Call]:
    """What IAM authorises for one API call: the action on its resource, and the KMS
    calls the service makes with the caller's credentials on the storage key ``key``
    (S3 objects and SQS messages are SSE-KMS)."""
    if service == "dynamodb":
        table = arn("dynamodb", f"table/{params['TableName']}")
        if "IndexName" in params:
            table += f"/index/{params['IndexName']}"
        return [Call(f"dynamodb:{operation}", table)]
    if service == "s3" and operation == "PutObject":
        target = _object(params["Bucket"], params["Key"])
        return [Call("s3:PutObject", target), Call("kms:GenerateDataKey", key)]
    if service == "s3" and operation in ("GetObject", "HeadObject"):  # HEAD is GetObject
        return [
            Call("s3:GetObject", _object(params["Bucket"], params["Key"])),
            Call("kms:Decrypt", key),
        ]
    if service == "sqs":
        name = params.get("QueueName") or str(params["QueueUrl"]).rsplit("/", 1)[-1]
        calls = [Call(f"sqs:{operation}", arn("sqs", name))]
        if operation == "SendMessage":
            calls += [Call("kms:GenerateDataKey", key), Call("kms:Decrypt", key)]
        if operation == "ReceiveMessage":
            calls.append(Call("kms:Decrypt", key))
        return calls
    if service == "sns" and operation == "Publish":
        return [Call("sns:Publish", params["TopicArn"])]
    raise AssertionError(
        f"no IAM model of {service}:{operation}: add it to tests/unit/async_calls.py"
    )


@dataclass
class Recorder:
    """boto3 clients on moto whose calls are noted as IAM calls."""

    key: str
    calls: set[Call] = field(default_factory=set)

    def client(self, service: str) -> Any:
        import boto3

        made = boto3.client(service, region_name=REGION)
        made.meta.events.register("before-parameter-build.*.*", self._note)
        return made

    def _note(self, params: Mapping[str, Any], model: Any, **_: Any) -> None:
        service = model.service_model.service_name
        self.calls.update(iam_calls(service, model.name, params, self.key))


@dataclass
class FakeLambda:
    """Lambda's event source mapping API for the one mapping of a template: listed when
    asked for by its function's name and its queue, as Lambda filters."""

    function: str
    queue_arn: str
    uuid: str
    state: str
    calls: set[Call]

    def list_event_source_mappings(self, FunctionName: str, EventSourceArn: str) -> Any:
        self.calls.add(Call("lambda:ListEventSourceMappings", ANY))
        found = FunctionName == self.function and EventSourceArn == self.queue_arn
        mapping = {"UUID": self.uuid, "State": self.state, "EventSourceArn": self.queue_arn}
        return {"EventSourceMappings": [mapping] if found else []}

    def update_event_source_mapping(self, UUID: str, Enabled: bool) -> Any:
        self.calls.add(
            Call("lambda:UpdateEventSourceMapping", arn("lambda", f"event-source-mapping:{UUID}"))
        )
        self.state = "Enabled" if Enabled else "Disabled"
        return {"UUID": UUID, "State": self.state}


@contextlib.contextmanager
def _moto() -> Iterator[None]:
    """In-process moto with dummy credentials (no endpoint override may leak in)."""
    from moto import mock_aws

    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
    }
    leaked = [name for name in os.environ if name.startswith("AWS_ENDPOINT_URL")]
    with mock.patch.dict(os.environ, env), mock_aws():
        for name in leaked:
            os.environ.pop(name)
        yield


def _create_stores(storage: Stack, settings: AsyncSettings) -> None:
    """The storage stack's async table, queues and bucket, in moto, from its template."""
    import boto3

    table = storage.properties("AsyncTable")
    boto3.client("dynamodb", region_name=REGION).create_table(
        TableName=str(settings.table),
        **{
            k: table[k]
            for k in ("AttributeDefinitions", "KeySchema", "GlobalSecondaryIndexes", "BillingMode")
        },
    )
    queue = storage.properties("AsyncQueue")
    sqs = boto3.client("sqs", region_name=REGION)
    dead_letters = queue["RedrivePolicy"]["deadLetterTargetArn"]
    sqs.create_queue(QueueName=dead_letters.rsplit(":", 1)[-1])
    redrive = {k: str(v) for k, v in queue["RedrivePolicy"].items()}
    sqs.create_queue(
        QueueName=str(settings.queue_url).rsplit("/", 1)[-1],
        Attributes={
            "VisibilityTimeout": str(queue["VisibilityTimeout"]),
            "RedrivePolicy": json.dumps(redrive),
        },
    )
    bucket = str(settings.location).removeprefix("s3://").split("/", 1)[0]
    boto3.client("s3", region_name=REGION).create_bucket(Bucket=bucket)
    if settings.topic_arn:
        name = settings.topic_arn.rsplit(":", 1)[-1]
        boto3.client("sns", region_name=REGION).create_topic(Name=name)


def _raw_client(service: str) -> Any:
    import boto3

    return boto3.client(service, region_name=REGION)


class _Service:
    """The CPU fallback's ``infer``: a V2 result, or a server fault."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def infer(
        self,
        model: str,
        version: str | None,
        body: bytes,
        length: int | None,
        stored_scope: str | None = None,
    ) -> Any:
        if self.fail:
            raise InferenceError("the model failed")
        return SimpleNamespace(body=RESULT, header_length=None, version=1)


def _consume(store: AsyncStore, ids: list[str], max_attempts: int) -> None:
    """The GPU consumer's store calls on the requests ``ids``: each received, claimed and
    read; the first two succeed, the last fails, is retried, and on its last delivery
    is given up (its message to the DLQ)."""
    messages = {message.id: message for message in store.receive(10, 0)}
    assert set(messages) == set(ids), messages
    jobs = [store.claim(messages[rid], "gpu") for rid in ids]
    for job in jobs:
        assert job is not None
        store.read_input(job)
    *succeeding, failing = jobs
    for job in succeeding:
        assert job is not None
        assert store.settle(job, infer_reply(RESULT, None, 1)) == "succeeded"
    assert failing is not None
    fault = error_reply(InferenceError("the model failed"))
    assert store.settle(failing, fault) is None  # retried
    last = store.claim(replace(failing.message, receive_count=max_attempts), "gpu")
    assert last is not None
    assert store.settle(last, fault) == "failed"


def _sqs_records(queue_url: str) -> dict[str, dict[str, Any]]:
    """The records an SQS event source mapping would hand the function, by request id."""
    raw = _raw_client("sqs").receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10)
    records = [
        {
            "messageId": m["MessageId"],
            "receiptHandle": m["ReceiptHandle"],
            "body": m["Body"],
            "attributes": {"ApproximateReceiveCount": "1"},
            "eventSource": "aws:sqs",
        }
        for m in raw.get("Messages", [])
    ]
    return {message_of(record).id: record for record in records}


def _drain(store: AsyncStore, ids: list[str], function_name: str, lambda_api: Any) -> None:
    """The CPU function's calls: the drain check, then SQS batches of ``ids`` (the first
    succeeds, the second fails until its last delivery)."""
    from spillway.fallback.async_drain import drain_check, handle_sqs_event

    drain_check(store, function_name, lambda_api)
    records = _sqs_records(str(store.queue_url))
    assert set(records) == set(ids), records
    ok, failing = (records[rid] for rid in ids)
    service: Any = _Service(fail=False)
    assert handle_sqs_event(service, store, {"Records": [ok]}) == {"batchItemFailures": []}
    for count in (1, store.settings.max_attempts):
        delivery = {**failing, "attributes": {"ApproximateReceiveCount": str(count)}}
        handle_sqs_event(_Service(fail=True), store, {"Records": [delivery]})  # type: ignore[arg-type]
    record = store.find(ids[1])
    assert record is not None
    assert record.state == "failed"


def _submit(store: AsyncStore, tenant: str, **places: str) -> str:
    record, replayed = store.submit(
        tenant=tenant,
        model="digits",
        version=None,
        body=BODY.encode(),
        header_length=None,
        input_location=places.get("input_location"),
        output_location=places.get("output_location"),
    )
    assert not replayed
    return record.id


def record_calls(
    storage: Stack,
    envs: Mapping[str, Mapping[str, str]],
    function_name: str,
    lambda_api: FakeLambda,
) -> dict[str, set[Call]]:
    """The IAM calls of the ``router``, ``gpu`` and ``cpu`` code, each with its own
    environment from ``envs`` (the event source mapping's polling is Lambda's:
    ``event_source_polling``). ``function_name`` is the CPU function's, as its context
    names it to the drain check."""
    key = storage.get_att("Key", "Arn")
    settings = {name: AsyncSettings.from_env(envs[name]) for name in ("router", "gpu", "cpu")}
    recorders = {name: Recorder(key) for name in settings}
    lambda_api.calls = recorders["cpu"].calls
    with _moto():
        _create_stores(storage, settings["router"])
        bucket = str(settings["router"].location).removeprefix("s3://").split("/", 1)[0]
        # alice's own area (async/inputs/<scope>/): where she may name inputs and outputs
        area = f"async/inputs/{scope('alice')}"
        _raw_client("s3").put_object(Bucket=bucket, Key=f"{area}/b.json", Body=BODY.encode())
        stores = {
            name: AsyncStore(settings[name], clients=recorders[name].client) for name in settings
        }
        router = stores["router"]
        places = {
            "input_location": f"s3://{bucket}/{area}/b.json",
            "output_location": f"s3://{bucket}/{area}/b-out/",
        }
        ids = [
            _submit(router, "alice"),
            _submit(router, "alice", **places),
            _submit(router, "alice"),
        ]
        _consume(stores["gpu"], ids, settings["gpu"].max_attempts)
        for rid in ids:
            router.result_reply(rid, "alice")
        _drain(
            stores["cpu"],
            [_submit(router, "bob"), _submit(router, "bob")],
            function_name,
            lambda_api,
        )
    return {name: recorder.calls for name, recorder in recorders.items()}


def event_source_polling(queue_arn: str, key: str) -> set[Call]:
    """What Lambda's event source mapping does with the function's role: poll the queue
    (its messages decrypted) and delete what the batch finished."""
    return {
        Call(f"sqs:{action}", queue_arn)
        for action in ("ReceiveMessage", "DeleteMessage", "GetQueueAttributes")
    } | {Call("kms:Decrypt", key)}


def lambda_api_of(app: Stack) -> FakeLambda:
    """The fake Lambda API holding ``app``'s drain mapping, enabled (so a check with no
    old backlog disables it)."""
    props = app.properties("AsyncDrainMapping")
    return FakeLambda(
        function=str(props["FunctionName"]),
        queue_arn=str(props["EventSourceArn"]),
        uuid=app.ref("AsyncDrainMapping"),
        state="Enabled",
        calls=set(),
    )
