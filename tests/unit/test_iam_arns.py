"""Every role may make the calls its service really makes, on the ARNs it makes them on.

GIVEN every stack resolved as CloudFormation would resolve it (``tests.unit.stacks``:
``Ref``/``GetAtt``/``Sub``/``ImportValue`` with the documented return values of each
resource type, account 123456789012, us-east-1)
WHEN each call a service makes for a role — the awslogs driver and Lambda writing logs,
the ECS agent pulling an image, the jobs function submitting a Batch job, S3 reading a
model, and every call the async-inference code makes, recorded by running it with each
component's deployed environment (``tests.unit.async_calls``) — is matched against the
role's policies with IAM's own wildcard rules
THEN every call is allowed, and no resource pattern in any policy matches nothing — in
every partition (``aws``, ``aws-cn``, ``aws-us-gov``): the stacks are resolved again
with each, and each ARN a policy or a state machine names is that partition's.

ARN forms (AWS service authorization reference and the CloudWatch Logs guide):

* CloudWatch Logs: ``log-group:NAME`` is the group (tagging calls only); IAM policies
  name a group as ``log-group:NAME:*`` for every other call — which is what a log group's
  ``GetAtt Arn`` returns — because the ARN IAM evaluates for ``CreateLogStream`` and
  ``PutLogEvents`` is the stream's, ``log-group:NAME:log-stream:STREAM`` (the form
  AccessDenied messages name), and ``log-group:NAME:log-stream:`` for group-level reads
  such as ``DescribeLogStreams``.
* S3: a bucket is ``arn:aws:s3:::BUCKET``, an object ``arn:aws:s3:::BUCKET/KEY``.
* DynamoDB: ``table/NAME``; SQS: ``arn:aws:sqs:REGION:ACCOUNT:NAME``; SSM:
  ``parameter/NAME`` (a name starting with ``/`` keeps it once); Lambda:
  ``function:NAME[:QUALIFIER]``; Batch: ``job-queue/NAME``,
  ``job-definition/NAME[:REVISION]``, ``job/ID``; ECR: ``repository/NAME``; Step
  Functions: ``stateMachine:NAME`` (``StartExecution``), ``execution:NAME:ID``.
* Actions without resource-level permissions are evaluated against ``*``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from infra.checks import cfn_eval
from infra.checks.cfn_eval import Stack, arn
from infra.checks.iam_eval import allowed, glob_matches, statements, universe
from tests.unit.async_calls import (
    Application,
    applications,
    event_source_polling,
    gpu_task_env,
    lambda_api_of,
    record_calls,
    sam_application,
    sls_application,
)
from tests.unit.stacks import (
    SLS_STACK,
    Deployment,
    deploy,
    serverless_config,
    serverless_template,
)

LAMBDA_STREAM = "2026/11/30/[$LATEST]0123456789abcdef0123456789abcdef"
TASK_ID = "0123456789abcdef0123456789abcdef"
ANY = "*"  # an action with no resource-level permissions
SCOPE = "0123456789abcdef0123456789abcdef"  # a tenant's scope (spillway.state.table.scope)
# Where job data lives (spillway/tenancy/areas.py): a tenant's area, what the router staged for
# it, the operator's nightly folder.
JOB_AREAS = (f"tenants/{SCOPE}/", f"staging/router/{SCOPE}/", "nightly/")
PLAN_KEY = "out/6f1d7c1e-3b0a-5c4e-9a57-5b1f0e2d8c41/_plan.json"


@dataclass(frozen=True)
class Need:
    """A call a service makes with ``owner``'s permissions, on a concrete ARN."""

    owner: str
    action: str
    resource: str

    def __str__(self) -> str:
        return f"{self.owner} {self.action} {self.resource.rsplit(':', 2)[-1][-40:]}"


def _stream(stack: Stack, group: str, stream: str) -> str:
    return arn("logs", f"log-group:{stack.physical_name(group)}:log-stream:{stream}")


def _writes_logs(owner: str, stack: Stack, group: str, stream: str) -> list[Need]:
    target = _stream(stack, group, stream)
    return [Need(owner, "logs:CreateLogStream", target), Need(owner, "logs:PutLogEvents", target)]


def _reads_models(owner: str, d: Deployment, key: str = "digits/1/model.onnx") -> list[Need]:
    bucket = d.storage.get_att("ModelsBucket", "Arn")
    return [
        Need(owner, "s3:ListBucket", bucket),
        Need(owner, "s3:GetObject", f"{bucket}/models/{key}"),
        Need(owner, "kms:Decrypt", d.storage.get_att("Key", "Arn")),
    ]


def _pulls_gpu_image(owner: str, d: Deployment) -> list[Need]:
    repository = d.storage.get_att("GpuImageRepository", "Arn")
    pulls = ["ecr:BatchCheckLayerAvailability", "ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer"]
    return [Need(owner, "ecr:GetAuthorizationToken", ANY)] + [
        Need(owner, action, repository) for action in pulls
    ]


def _application(stack: Stack, d: Deployment, cpu_function: str, qualifier: str) -> list[Need]:
    """The SAM and the Serverless application make the same calls (names differ)."""
    jobs_bucket, key = d.storage.get_att("JobsBucket", "Arn"), d.storage.get_att("Key", "Arn")
    definition = d.batch.physical_name("JobDefinition")
    eni = [
        arn("ec2", "network-interface/eni-0123456789abcdef0"),
        arn("ec2", "subnet/subnet-0123456789abcdef0"),
        arn("ec2", "security-group/sg-0123456789abcdef0"),
    ]
    needs = [
        *_writes_logs("RouterRole", stack, "RouterLogGroup", LAMBDA_STREAM),
        Need("RouterRole", "ssm:GetParameter", stack.identity("RouterPolicyParameter").arns[0]),
        Need("RouterRole", "lambda:InvokeFunction", stack.get_att(cpu_function, "Arn") + qualifier),
        Need("RouterRole", "ec2:DescribeNetworkInterfaces", ANY),
        *(Need("RouterRole", "ec2:CreateNetworkInterface", target) for target in eni),
        Need("RouterRole", "ec2:DeleteNetworkInterface", eni[0]),
        Need("RouterRole", "xray:PutTraceSegments", ANY),
        # The OpenAI-compatible door: where the repository is, the model list, a model's
        # signature and versions.
        Need(
            "RouterRole",
            "ssm:GetParameter",
            stack.identity("RouterModelRepositoryParameter").arns[0],
        ),
        *_reads_models("RouterRole", d, "minilm/config.json"),
        Need(
            "RouterRole",
            "s3:GetObject",
            f"{d.storage.get_att('ModelsBucket', 'Arn')}/models/minilm/1/SHA256SUMS",
        ),
        *_writes_logs("CpuInferRole", stack, "CpuInferLogGroup", LAMBDA_STREAM),
        *_reads_models("CpuInferRole", d),
        *_writes_logs("JobsRole", stack, "JobsLogGroup", LAMBDA_STREAM),
        *(
            Need("JobsRole", f"dynamodb:{action}", stack.get_att("JobsTable", "Arn"))
            for action in ("GetItem", "PutItem", "UpdateItem", "DeleteItem")
        ),
        Need("JobsRole", "batch:SubmitJob", d.batch.ref("JobQueue")),
        Need("JobsRole", "batch:SubmitJob", arn("batch", f"job-definition/{definition}")),
        Need("JobsRole", "batch:SubmitJob", arn("batch", f"job-definition/{definition}:3")),
        Need("JobsRole", "batch:TagResource", arn("batch", f"job/{TASK_ID}")),
        Need("JobsRole", "batch:DescribeJobs", ANY),
        *_reads_models("JobsRole", d, "digits/config.json"),
        Need("JobsRole", "s3:ListBucket", jobs_bucket),
        *(
            Need("JobsRole", action, f"{jobs_bucket}/{area}{key}")
            for area in JOB_AREAS
            for action, key in (("s3:GetObject", "in/0.jsonl"), ("s3:PutObject", PLAN_KEY))
        ),
        Need("JobsRole", "kms:GenerateDataKey", key),
        Need("JobsRole", "sqs:SendMessage", stack.get_att("JobsDeadLetterQueue", "Arn")),
        Need(
            "ScheduleDeadLetterQueuePolicy",
            "sqs:SendMessage",
            stack.get_att("ScheduleDeadLetterQueue", "Arn"),
        ),
    ]
    return needs


CONNECTION = "L0SM9cOFvHcCIhw="  # a WebSocket connection id as API Gateway makes them


def _websocket(stack: Stack, api: str, log_group: str, stage: str = "prod") -> list[Need]:
    """The WebSocket function (the router's role): its logs, the connection items in the
    router's state table, and each @connections call on a real-shaped ARN,
    ``arn:aws:execute-api:REGION:ACCOUNT:API_ID/STAGE/METHOD/@connections/CONNECTION``."""
    table = stack.get_att("RouterStateTable", "Arn")
    connections = arn("execute-api", f"{stack.ref(api)}/{stage}")
    return [
        *_writes_logs("RouterRole", stack, log_group, LAMBDA_STREAM),
        *(
            Need("RouterRole", f"dynamodb:{action}", table)
            for action in ("GetItem", "PutItem", "UpdateItem", "DeleteItem", "BatchWriteItem")
        ),
        *(
            Need("RouterRole", "execute-api:ManageConnections",
                 f"{connections}/{method}/@connections/{CONNECTION}")
            for method in ("POST", "GET", "DELETE")
        ),
    ]  # fmt: skip


def test_answers_are_pushed_on_this_apis_stage_only() -> None:
    # GIVEN the WebSocket function's policy in both forms
    for stack, api in ((DEPLOYMENT.sam, "WebSocketApi"), (DEPLOYMENT.sls, "WebsocketsApi")):
        found = statements(stack)
        push = arn("execute-api", f"{stack.ref(api)}/prod/POST/@connections/{CONNECTION}")
        # THEN it may post to this API's prod stage, nowhere else
        assert allowed(found, "RouterRole", "execute-api:ManageConnections", push)
        for other in (
            push.replace("/prod/", "/dev/"),
            arn("execute-api", f"a0b1c2d3e4/prod/POST/@connections/{CONNECTION}"),
            push.replace("/POST/@connections/", "/POST/infer/"),
        ):
            assert not allowed(found, "RouterRole", "execute-api:ManageConnections", other)


def _pipeline(stack: Stack, d: Deployment, target: str) -> list[Need]:
    """An async request for the topics pipeline: the router starts an execution of its
    state machine, whose states invoke ``target`` (the CPU function as the router invokes
    it) and, as a last resort, write the error under async/."""
    rid = "0123456789abcdef0123456789abcdef"
    jobs_bucket, key = d.storage.get_att("JobsBucket", "Arn"), d.storage.get_att("Key", "Arn")
    return [
        Need("RouterRole", "states:StartExecution", stack.ref("TopicsPipelineStateMachine")),
        Need("TopicsPipelineRole", "lambda:InvokeFunction", target),
        Need("TopicsPipelineRole", "s3:PutObject", f"{jobs_bucket}/async/{rid}/error.json"),
        Need("TopicsPipelineRole", "kms:GenerateDataKey", key),
    ]


def _reads_scope_proof_key(owner: str, d: Deployment) -> list[Need]:
    """The tenant scope proof key read as ``spillway.tenancy.proof.SecretKeys`` reads it:
    ``GetSecretValue`` on the storage stack's secret (``secret:NAME-XXXXXX``, the ARN a
    Ref returns), which Secrets Manager decrypts with the caller's ``kms:Decrypt`` on the
    storage key (https://docs.aws.amazon.com/secretsmanager/latest/userguide/security-encryption.html)."""
    secret = d.storage.ref("ScopeProofKeySecret")
    assert secret.startswith(arn("secretsmanager", "secret:"))
    return [
        Need(owner, "secretsmanager:GetSecretValue", secret),
        Need(owner, "kms:Decrypt", d.storage.get_att("Key", "Arn")),
    ]


def _async_calls(app: Application, gpu: Stack, d: Deployment) -> dict[str, list[Need]]:
    """The async code's calls with this application's and the GPU task's environment:
    the router's and CPU function's (their roles in ``app``), the GPU task's."""
    envs = {"router": app.router_env, "cpu": app.cpu_env, "gpu": gpu_task_env(gpu)}
    function = app.stack.ref(app.cpu_function)
    calls = record_calls(d.storage, envs, function, lambda_api_of(app.stack))
    queue = d.storage.get_att("AsyncQueue", "Arn")
    calls["cpu"] |= event_source_polling(queue, d.storage.get_att("Key", "Arn"))
    owners = {"router": "RouterRole", "cpu": "CpuInferRole", "gpu": "TaskRole"}
    return {
        name: [
            Need(owners[name], c.action, c.resource)
            for c in sorted(found, key=lambda c: (c.action, c.resource))
        ]
        for name, found in calls.items()
    }


def needs(d: Deployment, recorded: bool = True) -> Iterator[tuple[Stack, Need]]:
    """Every (stack, call) pair of the deployment (``recorded``: with the calls recorded
    from the async code against moto, which knows the ``aws`` partition alone)."""
    gpu, batch, network = d.gpu, d.batch, d.network
    async_calls = (
        [(app.stack, _async_calls(app, gpu, d)) for app in applications(d)] if recorded else []
    )
    gpu_async = async_calls[0][1]["gpu"] if async_calls else []
    access_logs = d.storage.get_att("AccessLogsBucket", "Arn")
    job_data = d.storage.get_att("JobsBucket", "Arn")
    by_stack: list[tuple[Stack, list[Need]]] = [
        (network, [
            *_writes_logs("FlowLogRole", network, "FlowLogGroup", "eni-0123456789abcdef0-all"),
            Need("FlowLogRole", "logs:DescribeLogStreams",
                 arn("logs", f"log-group:{network.physical_name('FlowLogGroup')}:log-stream:")),
        ]),
        (d.storage, [
            Need("AccessLogsBucketPolicy", "s3:PutObject",
                 f"{access_logs}/{prefix}/2026-11-30-01-00-00-0A1B2C3D")
            for prefix in ("models", "jobs")
        ]),
        (gpu, [
            *_pulls_gpu_image("ExecutionRole", d),
            *(
                log
                for container in ("gpu-service", "metrics")  # prefix/container/task
                for log in _writes_logs("ExecutionRole", gpu, "ServiceLogGroup",
                                        f"{container}/{container}/{TASK_ID}")
            ),
            Need("ExecutionRole", "secretsmanager:GetSecretValue", gpu.ref("AdminTokenSecret")),
            *_reads_models("TaskRole", d),
            *_writes_logs("TaskRole", gpu, "MetricsLogGroup", f"otel-stream-{TASK_ID}"),
            *gpu_async,
        ]),
        (batch, [
            *_pulls_gpu_image("ExecutionRole", d),
            *_writes_logs("ExecutionRole", batch, "JobLogGroup", f"job/default/{TASK_ID}"),
            *_reads_models("JobRole", d),
            Need("JobRole", "s3:ListBucket", job_data),
            *(
                Need("JobRole", action, f"{job_data}/{area}out/part-00000.jsonl")
                for area in JOB_AREAS
                for action in ("s3:GetObject", "s3:PutObject", "s3:DeleteObject")
            ),
            Need("JobRole", "kms:GenerateDataKey", d.storage.get_att("Key", "Arn")),
        ]),
        (d.observability, [
            Need("AlarmTopicPolicy", "sns:Publish", d.observability.ref("AlarmTopic")),
        ]),
        (d.sam, _application(d.sam, d, "CpuInferFunction", ":live")),
        (d.sls, _application(d.sls, d, "CpuInferLambdaFunction", "")),
        (d.sam, _websocket(d.sam, "WebSocketApi", "WebSocketLogGroup")),
        (d.sls, _websocket(d.sls, "WebsocketsApi", "WebsocketLogGroup")),
        (d.sam, _pipeline(d.sam, d, d.sam.get_att("CpuInferFunction", "Arn") + ":live")),
        (d.sls, _pipeline(d.sls, d, d.sls.get_att("CpuInferLambdaFunction", "Arn"))),
        (gpu, _reads_scope_proof_key("TaskRole", d)),
        *(
            (app, _reads_scope_proof_key(role, d))
            for app in (d.sam, d.sls, *([d.packaged] if d.packaged is not None else []))
            for role in ("RouterRole", "CpuInferRole")
        ),
    ]  # fmt: skip
    if d.packaged is not None:
        by_stack.append((d.packaged, _application(d.packaged, d, "CpuInferLambdaFunction", "")))
        by_stack.append((d.packaged, _websocket(d.packaged, "WebsocketsApi", "WebsocketLogGroup")))
    for app_stack, made in async_calls:
        by_stack.append((app_stack, [*made["router"], *made["cpu"]]))
    for stack, calls in by_stack:
        for call in calls:
            yield stack, call


DEPLOYMENT = deploy()
NEEDS = list(needs(DEPLOYMENT))


@pytest.mark.parametrize(
    ("stack", "need"), NEEDS, ids=[f"{s.name}:{n}" for s, n in NEEDS]
)  # fmt: skip
def test_the_call_is_allowed(stack: Stack, need: Need) -> None:
    # WHEN the service makes the call with the role's credentials
    # THEN the role's policies allow it on that exact ARN
    found = statements(stack)
    ok = allowed(found, need.owner, need.action, need.resource)
    patterns = [s.resources for s in found if s.owner == need.owner]
    assert ok, f"{need.owner} may not {need.action} on {need.resource}; it has {patterns}"


@pytest.mark.parametrize("stack", DEPLOYMENT.all(), ids=[s.name for s in DEPLOYMENT.all()])
def test_no_resource_pattern_matches_nothing(stack: Stack) -> None:
    # GIVEN every ARN of every resource of the deployment and every call a role makes
    known = universe(DEPLOYMENT.all())
    called = [need.resource for s, need in NEEDS if s is stack]
    dead = [
        f"{statement.owner}/{statement.sid}: {pattern}"
        for statement in statements(stack)
        if statement.effect == "Allow"
        for pattern in statement.resources
        if pattern != "*"
        and not known.covers(pattern)
        and not any(glob_matches(pattern, target) for target in called)
    ]
    # THEN each pattern a policy allows matches something real
    assert dead == []


TOPIC = arn("sns", "spillway-async-done")


def _with_topic(d: Deployment) -> list[tuple[Application, Stack]]:
    """(application, GPU stack) pairs deployed with ``AsyncTopicArn``/``asyncTopicArn``."""
    gpu = d.gpu.with_parameters(AsyncTopicArn=TOPIC)
    cli = {"asyncTopicArn": TOPIC}
    sls = Stack(SLS_STACK, serverless_template(serverless_config(cli)), {}, d.sls.exports)
    return [(sam_application(d.sam.with_parameters(AsyncTopicArn=TOPIC)), gpu),
            (sls_application(sls, cli), gpu)]  # fmt: skip


def test_async_notifications_are_allowed_on_the_given_topic_only() -> None:
    # GIVEN the default deployment (no topic): nobody may publish
    for stack, owner in ((DEPLOYMENT.sam, "CpuInferRole"), (DEPLOYMENT.gpu, "TaskRole")):
        assert not any("sns:Publish" in s.actions for s in statements(stack) if s.owner == owner)
    # WHEN the application and the GPU stack are given a topic
    for app, gpu in _with_topic(DEPLOYMENT):
        calls = _async_calls(app, gpu, DEPLOYMENT)
        # THEN both consumers publish to it (the code does, with that environment) …
        published = [n for n in calls["cpu"] + calls["gpu"] if n.action == "sns:Publish"]
        assert {(n.owner, n.resource) for n in published} == {("CpuInferRole", TOPIC),
                                                             ("TaskRole", TOPIC)}  # fmt: skip
        # … and their roles allow exactly that, the router's nothing
        for need in published:
            stack = gpu if need.owner == "TaskRole" else app.stack
            assert allowed(statements(stack), need.owner, need.action, need.resource), need
        assert not allowed(statements(app.stack), "RouterRole", "sns:Publish", TOPIC)


def test_a_log_groups_arn_attribute_already_ends_in_a_wildcard() -> None:
    # GIVEN the batch job's log group, as CloudFormation's GetAtt returns it
    group = DEPLOYMENT.batch.get_att("JobLogGroup", "Arn")
    stream = _stream(DEPLOYMENT.batch, "JobLogGroup", f"job/default/{TASK_ID}")
    # THEN the attribute itself matches the streams; appending ":log-stream:*" matches none
    assert group.endswith(":*")
    assert glob_matches(group, stream)
    assert not glob_matches(f"{group}:log-stream:*", stream)


@pytest.mark.parametrize(
    ("pattern", "value", "expected"),
    [
        ("arn:aws:s3:::b/models/*", "arn:aws:s3:::b/models/digits/1/model.onnx", True),
        ("arn:aws:s3:::b/models/*", "arn:aws:s3:::b/Models/x", False),  # case-sensitive
        ("arn:aws:s3:::b/models/*", "arn:aws:s3:::b/models", False),
        ("arn:aws:lambda:*:*:function:f?", "arn:aws:lambda:r:1:function:f1", True),
        ("arn:aws:lambda:*:*:function:f?", "arn:aws:lambda:r:1:function:f12", False),
        ("a.b", "axb", False),  # only * and ? are wildcards
    ],
)
def test_iam_wildcards(pattern: str, value: str, expected: bool) -> None:
    assert glob_matches(pattern, value) is expected
    assert glob_matches("S3:GetObject", "s3:getobject", case_sensitive=False)


JOB_ROLES = [
    *((app.stack, "JobsRole") for app in applications(DEPLOYMENT)),
    (DEPLOYMENT.batch, "JobRole"),
]


@pytest.mark.parametrize(
    ("stack", "owner"), JOB_ROLES, ids=[f"{s.name}:{o}" for s, o in JOB_ROLES]
)  # fmt: skip
@pytest.mark.parametrize(
    "key", ["async/r1/result.json", "staging/other/x.v2req", "elsewhere/x", "_plan.json"]
)
def test_job_roles_cannot_reach_job_data_outside_the_areas(
    stack: Stack, owner: str, key: str
) -> None:
    # GIVEN a key of the job data bucket outside tenants/, staging/router/ and nightly/
    target = f"{DEPLOYMENT.storage.get_att('JobsBucket', 'Arn')}/{key}"
    # THEN neither the jobs function nor a Batch job may read or write it
    found = statements(stack)
    for action in ("s3:GetObject", "s3:PutObject", "s3:DeleteObject"):
        assert not allowed(found, owner, action, target), (owner, action, key)


@pytest.mark.parametrize("stack", DEPLOYMENT.all(), ids=[s.name for s in DEPLOYMENT.all()])
def test_no_role_writes_the_model_repository(stack: Stack) -> None:
    # GIVEN an object a job or a request would inject into the repository
    models = DEPLOYMENT.storage.get_att("ModelsBucket", "Arn")
    injected = f"{models}/models/zz-injected/1/model.onnx"
    # THEN no role and no resource policy of any stack may write or delete it (models are
    # published with the operator's own credentials, never a service's role)
    writers = [
        f"{s.owner}/{s.sid}"
        for s in statements(stack)
        for action in ("s3:PutObject", "s3:DeleteObject")
        if s.effect == "Allow" and allowed([s], s.owner, action, injected)
    ]
    assert writers == []


def test_the_router_starts_executions_of_the_pipelines_machine_only() -> None:
    for stack in (DEPLOYMENT.sam, DEPLOYMENT.sls):
        found = statements(stack)
        machine = stack.ref("TopicsPipelineStateMachine")
        other = arn("states", "stateMachine:someone-elses")
        # THEN the router may start the topics machine, no other, and nothing else may
        assert allowed(found, "RouterRole", "states:StartExecution", machine)
        assert not allowed(found, "RouterRole", "states:StartExecution", other)
        starters = {s.owner for s in found if "states:StartExecution" in s.actions}
        assert starters == {"RouterRole"}, stack.name


@pytest.mark.parametrize(
    ("label", "provisioned", "target"),
    [("sam", 0, ":live"), ("serverless", 0, ""), ("serverless", 2, ":provisioned")],
)
def test_the_machine_invokes_the_function_as_the_router_does(
    label: str, provisioned: int, target: str
) -> None:
    # GIVEN the application (Serverless with and without provisioned concurrency)
    if label == "sam":
        app = sam_application(DEPLOYMENT.sam)
        machine = app.stack.properties("TopicsPipelineStateMachine")
    else:
        cli = {"cpuProvisionedConcurrency": provisioned}
        stack = Stack(SLS_STACK, serverless_template(serverless_config(cli)), {},
                      DEPLOYMENT.sls.exports)  # fmt: skip
        app = sls_application(stack, cli)
        machine = stack.properties("TopicsPipelineStateMachine")
    function = app.stack.get_att(app.cpu_function, "Arn")
    invoked = str(app.stack.resolve(machine["DefinitionSubstitutions"]["CpuInferFunctionArn"]))
    # THEN the states invoke what the router invokes: the alias with the provisioned
    # concurrency when there is one (never the unqualified function past it)
    router_target = app.router_env["ROUTER_CPU_FUNCTION"]
    assert invoked == function + target
    assert invoked.endswith(router_target.rsplit(":function:", 1)[-1])
    # AND the machine's role may invoke exactly that
    found = statements(app.stack)
    assert allowed(found, "TopicsPipelineRole", "lambda:InvokeFunction", invoked)
    for other in {function, f"{function}:live", f"{function}:provisioned", f"{function}:7"}:
        if other != invoked:
            assert not allowed(found, "TopicsPipelineRole", "lambda:InvokeFunction", other)


@pytest.mark.parametrize("partition", ["aws", "aws-cn", "aws-us-gov"])
def test_every_arn_is_the_partitions_and_every_call_is_allowed_there(
    partition: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN every stack deployed in the partition (its pseudo parameter and every ARN)
    monkeypatch.setattr(cfn_eval, "PARTITION", partition)
    monkeypatch.setitem(cfn_eval.PSEUDO, "AWS::Partition", partition)
    d = deploy.__wrapped__()
    # THEN each ARN a policy names is that partition's …
    foreign = [
        f"{stack.name}:{s.owner}/{s.sid}: {pattern}"
        for stack in d.all()
        for s in statements(stack)
        for pattern in s.resources
        if pattern.startswith("arn:") and not pattern.startswith(f"arn:{partition}:")
    ]
    assert foreign == []
    # … and so is each ARN the pipeline's state machine is given
    for stack in (d.sam, d.sls):
        values = stack.resolve(
            stack.properties("TopicsPipelineStateMachine")["DefinitionSubstitutions"]
        )
        assert values["LambdaInvoke"] == f"arn:{partition}:states:::lambda:invoke"
        assert values["S3PutObject"] == f"arn:{partition}:states:::aws-sdk:s3:putObject"
        assert str(values["CpuInferFunctionArn"]).startswith(f"arn:{partition}:lambda:")
    # AND every call a service makes there, on that partition's ARNs, is allowed
    refused = [
        f"{stack.name}:{need}"
        for stack, need in needs(d, recorded=False)
        if not allowed(statements(stack), need.owner, need.action, need.resource)
    ]
    assert refused == []
