"""Tracing and data capture are deployable, the same way in both template forms.

GIVEN every stack deployed offline as docs/deploy.md deploys it (``tests.unit.stacks``),
template.yaml with ``TraceSample`` at its default (0) or above it, serverless.yml for stage
``prod`` with ``traceSample`` likewise, and the GPU stack with its own ``TraceSample``
THEN a deployment without tracing pays nothing (no collector layer, no OTLP endpoint:
``spillway.tracing`` stays off), and one with it gives each zip function the ADOT collector
layer of its region (the ARN AWS publishes) and the endpoint that layer listens on, the
GPU task a traces pipeline in its non-essential collector sidecar started before it, and
only then X-Ray writes to the task role; the sample reaches the functions' versions; the
router writes capture records under its tenants' areas of the capture prefix and nowhere
else, and the storage stack expires that prefix after ``CaptureRetentionDays``.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from functools import cache
from typing import Any

import pytest
import yaml

from infra.checks.cfn_eval import Stack, load_cfn
from infra.checks.iam_eval import allowed, statements
from spillway import tracing
from spillway.capture.layout import Area, hour_of
from spillway.router.settings import RouterSettings
from tests.unit.async_calls import gpu_task_env, sam_function_env, sls_function_env
from tests.unit.stacks import ROOT, SLS_STACK, deploy, serverless_config, serverless_template

SAMPLE = "0.1"
ENDPOINT = "http://localhost:4318"
ZIP_FUNCTIONS = {"RouterFunction": "router", "WebSocketFunction": "websocket",
                 "JobsFunction": "jobs"}  # fmt: skip
SLS_LOGICAL = {"router": "RouterLambdaFunction", "websocket": "WebsocketLambdaFunction",
               "jobs": "JobsLambdaFunction"}  # fmt: skip
ROUTER_DOORS = {"RouterFunction": "router", "WebSocketFunction": "websocket"}
# The ADOT collector layer (collector only, amd64) as AWS publishes it, region by region:
# the table of https://aws-otel.github.io/docs/getting-started/lambda/lambda-go
# ("arn:aws:lambda:<region>:901920570463:layer:aws-otel-collector-<architecture>-ver-0-117-0:1",
# ADOT Collector v0.43.0) spelt out in aws-observability/aws-otel-lambda's
# go/sample-apps/aws-sdk/deploy/wrapper/layer_amd64.tf (README of 2025-05-30).
PUBLISHED_COLLECTOR_LAYERS = {
    region: f"arn:aws:lambda:{region}:901920570463:layer:aws-otel-collector-amd64-ver-0-117-0:1"
    for region in (
        "ap-northeast-1", "ap-northeast-2", "ap-south-1", "ap-southeast-1", "ap-southeast-2",
        "ca-central-1", "eu-central-1", "eu-north-1", "eu-west-1", "eu-west-2", "eu-west-3",
        "sa-east-1", "us-east-1", "us-east-2", "us-west-1", "us-west-2",
    )
}  # fmt: skip
# The documented patterns of both ADOT layer families (the Python one carries its own
# OpenTelemetry SDK into /opt/python, which would shadow the pinned one of our layer).
COLLECTOR_LAYER = re.compile(
    r"^arn:aws:lambda:(?P<region>[a-z]{2}(-[a-z]+)+-\d):901920570463:layer:"
    r"aws-otel-collector-amd64-ver-\d+-\d+-\d+:\d+$"
)
PYTHON_LAYER = re.compile(
    r"^arn:aws:lambda:[a-z]{2}(-[a-z]+)+-\d:901920570463:layer:aws-otel-python-(amd64|arm64)"
    r"-ver-\d+-\d+-\d+:\d+$"
)


@cache
def sam(sample: str = "0") -> Stack:
    """template.yaml deployed with ``TraceSample`` at ``sample``."""
    return deploy().sam.with_parameters(TraceSample=sample)


@cache
def gpu(sample: str = "0") -> Stack:
    """The GPU stack deployed with ``TraceSample`` at ``sample``."""
    return deploy().gpu.with_parameters(TraceSample=sample)


def _cli(sample: str) -> dict[str, Any]:
    return {"traceSample": sample}


@cache
def sls(sample: str = "0") -> Stack:
    """serverless.yml for stage prod deployed with ``--param=traceSample=<sample>``."""
    template = serverless_template(serverless_config(_cli(sample)))
    return Stack(SLS_STACK, template, {}, deploy().sls.exports)


def sam_layers(stack: Stack, function: str) -> list[str]:
    """The layer ARNs a SAM function runs with (the dependency layer's Ref included)."""
    return [str(layer) for layer in stack.properties(function).get("Layers", [])]


def sls_layers(stack: Stack, key: str, sample: str) -> list[str]:
    """The layers ``resources.extensions`` gives a Serverless function, resolved."""
    extension = serverless_config(_cli(sample))["resources"]["extensions"][SLS_LOGICAL[key]]
    layers = stack.resolve(extension["Properties"]["Layers"])
    return [] if layers is None or not isinstance(layers, list) else [str(x) for x in layers]


def collector_layers(layers: list[str]) -> list[str]:
    return [layer for layer in layers if ":layer:aws-otel-" in layer]


# --- tracing off: nothing to pay ---------------------------------------------------------


@pytest.mark.parametrize("function", [*ZIP_FUNCTIONS, "CpuInferFunction"])
def test_without_tracing_no_function_gets_a_collector_or_an_endpoint(function: str) -> None:
    # GIVEN template.yaml at its defaults (TraceSample 0)
    stack = sam()
    env = sam_function_env(stack, function)
    # THEN no collector layer and no endpoint: the function never imports OpenTelemetry
    assert not collector_layers(sam_layers(stack, function))
    assert (env["OTEL_EXPORTER_OTLP_ENDPOINT"], env["SPILLWAY_TRACE_SAMPLE"]) == ("", "0")
    assert not tracing.wanted(env)


@pytest.mark.parametrize("key", [*ZIP_FUNCTIONS.values(), "cpuInfer"])
def test_without_tracing_serverless_adds_nothing_either(key: str) -> None:
    stack = sls()
    env = sls_function_env(stack, key)
    assert (env["OTEL_EXPORTER_OTLP_ENDPOINT"], env["SPILLWAY_TRACE_SAMPLE"]) == ("", "0")
    assert not tracing.wanted(env)
    if key != "cpuInfer":
        assert sls_layers(stack, key, "0") == []


def test_without_tracing_the_gpu_task_exports_nothing_and_may_write_no_traces() -> None:
    stack = gpu()
    env = gpu_task_env(stack)
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == ""
    assert not tracing.wanted(env)
    xray = [s for s in statements(stack) if any(a.startswith("xray:") for a in s.actions)]
    assert xray == []
    assert "traces" not in _collector_config(stack)["service"]["pipelines"]


# --- tracing on: the collector, its endpoint, the sample ----------------------------------


@pytest.mark.parametrize("function", ZIP_FUNCTIONS)
def test_a_sample_gives_every_zip_function_the_collector_and_its_endpoint(function: str) -> None:
    # GIVEN template.yaml deployed with TraceSample 0.1 (in us-east-1)
    stack = sam(SAMPLE)
    env = sam_function_env(stack, function)
    layers = sam_layers(stack, function)
    # THEN the function runs its dependency layer and, after it, the region's published
    # collector layer, whose extension listens where the SDK exports
    assert len(layers) == 2
    assert collector_layers(layers) == [PUBLISHED_COLLECTOR_LAYERS["us-east-1"]] == layers[1:]
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == ENDPOINT
    assert env["SPILLWAY_TRACE_SAMPLE"] == SAMPLE
    assert tracing.wanted(env)


@pytest.mark.parametrize("key", ZIP_FUNCTIONS.values())
def test_serverless_gives_the_same_functions_the_same_collector(key: str) -> None:
    stack = sls(SAMPLE)
    env = sls_function_env(stack, key, _cli(SAMPLE))
    sam_name = next(name for name, sls_key in ZIP_FUNCTIONS.items() if sls_key == key)
    assert sls_layers(stack, key, SAMPLE) == collector_layers(sam_layers(sam(SAMPLE), sam_name))
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == ENDPOINT
    assert env["SPILLWAY_TRACE_SAMPLE"] == SAMPLE


def test_the_image_function_exports_nowhere_until_its_image_carries_a_collector() -> None:
    # GIVEN tracing on: an image function takes no layers, so none listens on 4318 there
    for env in (
        sam_function_env(sam(SAMPLE), "CpuInferFunction"),
        sls_function_env(sls(SAMPLE), "cpuInfer", _cli(SAMPLE)),
    ):
        # THEN the CPU fallback gets no endpoint (its exports would fail) but the sample
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == ""
        assert env["SPILLWAY_TRACE_SAMPLE"] == SAMPLE
        assert not tracing.wanted(env)
    assert "Layers" not in sam(SAMPLE).properties("CpuInferFunction")


def test_the_sample_reaches_the_aliased_versions() -> None:
    # GIVEN the functions invoked through their `live` alias: a version is published only
    # when its description changes (infra/checks/alias_versions.py; the check itself runs
    # in test_alias_versions and `make check-infra`)
    resources = load_cfn(ROOT / "template.yaml")["Resources"]
    for function in ("RouterFunction", "CpuInferFunction"):
        description = resources[function]["Properties"]["VersionDescription"]["Fn::Sub"]
        # THEN the sample is in each one's description, so a new value publishes
        assert "${TraceSample}" in description.split()
    # AND serverless.yml's versions hash the function's own properties: the sample is a
    # literal there (the endpoint and the layers are conditions, the same for any value)
    for sample in ("0", SAMPLE):
        config = serverless_config(_cli(sample))
        assert config["provider"]["environment"]["SPILLWAY_TRACE_SAMPLE"] == sample


def test_the_emitted_layer_is_the_one_aws_publishes_in_every_documented_region() -> None:
    # GIVEN the layer template.yaml and infra/serverless-extensions.yml write
    written = {
        layer["Fn::If"][1]["Fn::Sub"]
        for name in ZIP_FUNCTIONS
        for layer in load_cfn(ROOT / "template.yaml")["Resources"][name]["Properties"]["Layers"]
        if isinstance(layer, dict) and "Fn::If" in layer
    }
    extensions = serverless_config()["resources"]["extensions"]
    written |= {
        extensions[logical]["Properties"]["Layers"]["Fn::If"][1][0]["Fn::Sub"]
        for logical in SLS_LOGICAL.values()
    }
    assert len(written) == 1
    (template,) = written
    for region, published in PUBLISHED_COLLECTOR_LAYERS.items():
        # THEN in each region it resolves to the ARN AWS publishes there
        emitted = template.replace("${AWS::Partition}", "aws").replace("${AWS::Region}", region)
        assert emitted == published
        match = COLLECTOR_LAYER.match(emitted)
        assert match is not None
        assert match["region"] == region
        # … which is the collector-only family, not the Python SDK's
        assert not PYTHON_LAYER.match(emitted)
    # AND the patterns tell the families apart on the documented Python layer too
    python = "arn:aws:lambda:eu-west-1:901920570463:layer:aws-otel-python-amd64-ver-1-32-0:2"
    assert PYTHON_LAYER.match(python)
    assert not COLLECTOR_LAYER.match(python)


# --- the GPU task ----------------------------------------------------------------------


def _containers(stack: Stack) -> dict[str, dict[str, Any]]:
    task = stack.properties("TaskDefinition")
    return {c["Name"]: c for c in task["ContainerDefinitions"]}


def _collector_config(stack: Stack) -> dict[str, Any]:
    sidecar = _containers(stack)["metrics"]
    content = next(e["Value"] for e in sidecar["Environment"] if e["Name"] == "AOT_CONFIG_CONTENT")
    config: dict[str, Any] = yaml.safe_load(content)
    return config


def test_the_gpu_task_sends_its_spans_to_its_sidecar_collector() -> None:
    # GIVEN the GPU stack deployed with TraceSample 0.1
    stack = gpu(SAMPLE)
    env = gpu_task_env(stack)
    # THEN the service exports to localhost:4318 under its own name, at the sample
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == ENDPOINT
    assert env["OTEL_SERVICE_NAME"] == "spillway-gpu"
    assert env["SPILLWAY_TRACE_SAMPLE"] == SAMPLE
    assert tracing.wanted(env)
    # AND the sidecar's configuration is ADOT's ecs-xray pipeline, received on that port
    # of the task's loopback only, beside the metrics pipeline it had
    config = _collector_config(stack)
    pipelines = config["service"]["pipelines"]
    assert pipelines["traces"]["receivers"] == ["otlp"]
    assert pipelines["traces"]["exporters"] == ["awsxray"]
    assert pipelines["metrics"] == _collector_config(gpu())["service"]["pipelines"]["metrics"]
    protocols = config["receivers"]["otlp"]["protocols"]
    assert protocols == {"http": {"endpoint": "localhost:4318"}}
    assert config["exporters"]["awsxray"]["region"] == "us-east-1"


def test_the_collector_sidecar_starts_first_and_never_stops_serving() -> None:
    for sample in ("0", SAMPLE):
        containers = _containers(gpu(sample))
        sidecar, service = containers["metrics"], containers["gpu-service"]
        # THEN one collector (two in one awsvpc task would collide on its telemetry port)
        collectors = [c for c in containers.values() if "aws-otel-collector" in c["Image"]]
        assert collectors == [sidecar]
        assert re.search(r":v\d+\.\d+\.\d+$", sidecar["Image"]), "a pinned version tag"
        # AND a collector that crashes stops nothing: the service alone is essential
        assert sidecar["Essential"] is False
        assert service["Essential"] is True
        assert {"ContainerName": "metrics", "Condition": "START"} in service["DependsOn"]
        # AND the sidecar logs where the service does
        logs = [c["LogConfiguration"]["Options"]["awslogs-group"] for c in (sidecar, service)]
        assert logs[0] == logs[1] == gpu(sample).ref("ServiceLogGroup")


def test_only_a_traced_task_may_write_traces_and_nothing_else_of_x_ray() -> None:
    stack = gpu(SAMPLE)
    xray = [s for s in statements(stack) if any(a.startswith("xray:") for a in s.actions)]
    assert [(s.owner, s.effect) for s in xray] == [("TaskRole", "Allow")]
    assert set(xray[0].actions) == {"xray:PutTraceSegments", "xray:PutTelemetryRecords"}
    assert xray[0].resources == ("*",)  # X-Ray has no resource-level permissions for them
    assert allowed(statements(stack), "TaskRole", "xray:PutTraceSegments", "*")
    assert not allowed(statements(gpu()), "TaskRole", "xray:PutTraceSegments", "*")
    assert not allowed(statements(stack), "ExecutionRole", "xray:PutTraceSegments", "*")


# --- data capture ------------------------------------------------------------------------

TENANTS = ("tenant-a", "tenant-b")


def _capture_key(root: str, tenant: str) -> tuple[str, str]:
    """(bucket, key) of one capture object of ``tenant``, as the router's writer names it."""
    where = Area.of(root, tenant)
    written = datetime(2026, 12, 7, 19, 0, tzinfo=UTC)
    return where.bucket, where.object_key("digits", hour_of(written), written, "0a1b2c3d")


def _roots() -> dict[str, tuple[Stack, dict[str, str]]]:
    d = deploy()
    found = {f"sam:{name}": (d.sam, sam_function_env(d.sam, name)) for name in ROUTER_DOORS}
    found |= {f"sls:{key}": (d.sls, sls_function_env(d.sls, key)) for key in ROUTER_DOORS.values()}
    return found


@pytest.mark.parametrize("door", ["sam:RouterFunction", "sam:WebSocketFunction",
                                  "sls:router", "sls:websocket"])  # fmt: skip
def test_the_router_captures_under_the_job_data_buckets_capture_prefix(door: str) -> None:
    # GIVEN a router door of either form, as deployed
    stack, env = _roots()[door]
    storage = deploy().storage
    bucket = storage.ref("JobsBucket")
    # THEN its capture root is the capture/ prefix of the job-data bucket, which the
    # router's own settings accept
    root = env["ROUTER_CAPTURE_ROOT"]
    assert root == f"s3://{bucket}/capture"
    assert RouterSettings.from_env(env).capture_root == root
    # AND its role may write each tenant's records there, and read none back
    found = statements(stack)
    bucket_arn = storage.get_att("JobsBucket", "Arn")
    keys = {tenant: _capture_key(root, tenant)[1] for tenant in TENANTS}
    assert keys["tenant-a"] != keys["tenant-b"]
    for key in keys.values():
        assert key.startswith("capture/")
        assert allowed(found, "RouterRole", "s3:PutObject", f"{bucket_arn}/{key}")
        assert not allowed(found, "RouterRole", "s3:GetObject", f"{bucket_arn}/{key}")
    # AND nothing beside the prefix, and no other role, is opened by it
    assert not allowed(found, "RouterRole", "s3:PutObject", f"{bucket_arn}/captured/x")
    assert not allowed(found, "RouterRole", "s3:PutObject", f"{bucket_arn}/tenants/x")
    other = "CpuInferRole"
    assert not allowed(found, other, "s3:PutObject", f"{bucket_arn}/{keys['tenant-a']}")


@pytest.mark.parametrize("days", [None, "7"])
def test_capture_records_expire_after_the_retention(days: str | None) -> None:
    # GIVEN the storage stack at its default retention, or another one
    storage = deploy().storage
    if days is not None:
        storage = storage.with_parameters(CaptureRetentionDays=days)
    rules = storage.properties("JobsBucket")["LifecycleConfiguration"]["Rules"]
    capture = [rule for rule in rules if rule.get("Prefix") == "capture/"]
    # THEN one rule expires every capture object (the prefix the router's root names)
    assert len(capture) == 1
    rule = capture[0]
    assert rule["Status"] == "Enabled"
    assert int(rule["ExpirationInDays"]) == int(days or 30)
    assert int(rule["NoncurrentVersionExpiration"]["NoncurrentDays"]) == 1
    root = sam_function_env(deploy().sam, "RouterFunction")["ROUTER_CAPTURE_ROOT"]
    assert root.endswith("/" + rule["Prefix"].rstrip("/"))


def test_the_capture_permission_is_the_same_in_both_forms() -> None:
    def capture_statements(stack: Stack) -> set[tuple[str, tuple[str, ...], tuple[str, ...]]]:
        return {
            (s.owner, s.actions, s.resources)
            for s in statements(stack)
            if any("/capture/" in str(r) for r in s.resources)
        }

    d = deploy()
    assert capture_statements(d.sam) == capture_statements(d.sls)
    assert len(capture_statements(d.sam)) == 1
