"""The idle cost model: one line per billable thing a deployment runs while idle.

Each line builder reads a deployed shape (``infra.idle_cost.deployment``) and turns what
bills at idle into ``Line``s: one unit's monthly cost from ``infra.prices`` (with the
arithmetic shown) times the units the shape runs. What cannot be read from the templates
is assumed below (each assumption is printed under the table); resource types that cost
nothing at idle say why in ``FREE_AT_IDLE``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from infra import prices
from infra.idle_cost.deployment import Deployment, Shape, deploy

HOURS = prices.HOURS_PER_MONTH
MINUTES = prices.MINUTES_PER_MONTH
SECONDS = prices.SECONDS_PER_MONTH

# --- assumptions (each printed under the table) ---------------------------------------------
DRAIN_CHECK_S = 0.05
"""Duration of one drain check on a warm CPU function."""
COLD_START_HOURS_PER_DAY = 6
"""Hours a day the drain-checked CPU function has a cold start (Lambda replaces execution
environments every few hours even under steady invocation): its cold-start metric exists
in those hours only (metrics are billed by the hour they are sent)."""
MODELS_PUBLISHED = 1
METRICS_INSIGHTS_METRICS = 10
"""Metrics a Metrics Insights alarm's query analyses (the router's EMF series)."""
IMAGE_GB = {"GPU": 4.0, "CPU": 0.35}
"""Compressed size of one image in each repository (not measured: no Docker here)."""
LOG_BYTES = {"drain check": 600, "EMF record": 500, "Container Insights minute": 5000}
FLOW_LOG_GB = 0.05
"""Rejected flows logged a month (scans of the NAT gateway's public address)."""
# Container Insights (standard) metrics per cluster, per service and per task definition
# family: https://docs.aws.amazon.com/AmazonCloudWatch/latest/monitoring/Container-Insights-metrics-ECS.html
CI_CLUSTER, CI_SERVICE, CI_FAMILY = 11, 13, 8


_NONE = "no charge of its own"
_PER_USE = "charged per request or per use only"
FREE_AT_IDLE: dict[str, str] = {
    "AWS::Batch::ComputeEnvironment": "MinvCpus 0 (checked): instances run only for jobs",
    "AWS::Batch::JobQueue": _NONE,
    "AWS::Batch::JobDefinition": _NONE,
    "AWS::Serverless::Api": _PER_USE,
    "AWS::ApiGateway::RestApi": _PER_USE,
    "AWS::ApiGateway::Account": "an account setting",
    "AWS::ApiGateway::ApiKey": _NONE,
    "AWS::ApiGateway::Deployment": _NONE,
    "AWS::ApiGateway::Method": _NONE,
    "AWS::ApiGateway::Resource": _NONE,
    "AWS::ApiGateway::Stage": "no cache cluster: per request only",
    "AWS::ApiGateway::UsagePlan": _NONE,
    "AWS::ApiGateway::UsagePlanKey": _NONE,
    "AWS::ApiGatewayV2::Api": "WebSocket: messages and connection minutes only",
    "AWS::ApiGatewayV2::Deployment": _NONE,
    "AWS::ApiGatewayV2::Integration": _NONE,
    "AWS::ApiGatewayV2::Route": _NONE,
    "AWS::ApiGatewayV2::Stage": _NONE,
    "AWS::Serverless::StateMachine": "Standard workflow: state transitions only",
    "AWS::StepFunctions::StateMachine": "Standard workflow: state transitions only",
    "AWS::Serverless::LayerVersion": "within Lambda's free 75 GB of code storage",
    "AWS::Lambda::LayerVersion": "within Lambda's free 75 GB of code storage",
    "AWS::Lambda::Permission": _NONE,
    "AWS::Lambda::EventInvokeConfig": _NONE,
    "AWS::Lambda::EventSourceMapping": "disabled at creation; SQS polls only while draining",
    "AWS::Events::Rule": "scheduled rules are free; their targets are priced",
    "AWS::Serverless::Application": "a nested stack: its resources are priced",
    "AWS::CloudFormation::Stack": "a nested stack: its resources are priced",
    "AWS::CloudFormation::WaitConditionHandle": _NONE,
    "AWS::SNS::Topic": _PER_USE,
    "AWS::SNS::Subscription": _PER_USE,
    "AWS::SNS::TopicPolicy": _NONE,
    "AWS::SQS::QueuePolicy": _NONE,
    "AWS::S3::BucketPolicy": _NONE,
    "AWS::SSM::Parameter": "standard tier: no charge",
    "AWS::KMS::Alias": _NONE,
    "AWS::Route53::RecordSet": "alias queries to an ELB are free",
    "AWS::ECS::ClusterCapacityProviderAssociations": _NONE,
    "AWS::ElasticLoadBalancingV2::Listener": "in the ALB's hourly charge",
    "AWS::ElasticLoadBalancingV2::TargetGroup": "in the ALB's hourly charge",
    "AWS::ApplicationAutoScaling::ScalingPolicy": _NONE,
    "AWS::EC2::VPC": _NONE,
    "AWS::EC2::Subnet": _NONE,
    "AWS::EC2::RouteTable": _NONE,
    "AWS::EC2::Route": _NONE,
    "AWS::EC2::SubnetRouteTableAssociation": _NONE,
    "AWS::EC2::InternetGateway": _NONE,
    "AWS::EC2::VPCGatewayAttachment": _NONE,
    "AWS::EC2::VPCEndpoint": "gateway endpoints (S3, DynamoDB) are free",
    "AWS::EC2::SecurityGroup": _NONE,
    "AWS::EC2::SecurityGroupIngress": _NONE,
    "AWS::EC2::SecurityGroupEgress": _NONE,
    "AWS::IAM::Role": "IAM is free",
    "AWS::IAM::Policy": "IAM is free",
    "AWS::IAM::InstanceProfile": "IAM is free",
}
"""Resource types that cost nothing while nothing happens, and why; every other type the
templates use is priced by a line (``Line.types``)."""


@dataclass(frozen=True)
class Line:
    """One billable thing: a unit's monthly cost and how many units the shape runs."""

    item: str
    arithmetic: str
    unit_usd: float
    units: float
    types: tuple[str, ...]
    """The resource types this line prices."""

    @property
    def usd(self) -> float:
        """Its monthly cost in this shape."""
        return self.unit_usd * self.units


# --- the lines ------------------------------------------------------------------------------

_INSTANCE = ("AWS::AutoScaling::AutoScalingGroup", "AWS::EC2::LaunchTemplate",
             "AWS::ECS::CapacityProvider", "AWS::ECS::Service",
             "AWS::ApplicationAutoScaling::ScalableTarget")  # fmt: skip
_TASK = ("AWS::ECS::TaskDefinition",)
_FUNCTION = ("AWS::Serverless::Function", "AWS::Lambda::Function")


def usd_text(value: float) -> str:
    """A price as AWS writes it: fixed point, no trailing zeros (0.0000166667, 0.045)."""
    return f"{value:.10f}".rstrip("0").rstrip(".")


def _tasks(d: Deployment) -> int:
    return int(d.gpu.properties("ScalableTarget")["MinCapacity"])


def _hourly(price: prices.Price) -> tuple[str, float]:
    return f"{usd_text(price.usd)} × {HOURS}", price.usd * HOURS


def gpu_lines(d: Deployment) -> list[Line]:
    """Instances at the service's floor (one task each), their volumes and monitoring."""
    tasks, gpu = _tasks(d), d.gpu
    kind = gpu.parameter("InstanceType")
    volume = int(gpu.parameter("RootVolumeGiB"))
    template = gpu.properties("LaunchTemplate")["LaunchTemplateData"]
    monitored = template.get("Monitoring", {}).get("Enabled") in (True, "true")
    metrics = prices.DETAILED_MONITORING_METRICS if monitored else 0
    gp3, metric = prices.GP3_GB_MONTH.usd, prices.METRIC_MONTH.usd
    return [
        Line(f"GPU instance ({kind}; one per task, MinTasks of them)",
             *_hourly(prices.EC2_ON_DEMAND_HOUR[kind]), tasks, _INSTANCE),
        Line("its root volume (gp3)", f"{volume} GB × {gp3:g}", volume * gp3, tasks, _INSTANCE),
        Line("its EC2 detailed monitoring (launch template `Monitoring`)",
             f"{metrics} metrics × {metric:g}", metrics * metric, tasks, _INSTANCE),
    ]  # fmt: skip


def container_insights(d: Deployment) -> list[Line]:
    """Container Insights' metrics of the GPU cluster, billed as custom metrics."""
    (_, cluster), = d.resources("AWS::ECS::Cluster")  # fmt: skip
    settings = {s["Name"]: s["Value"] for s in cluster["Properties"].get("ClusterSettings", [])}
    mode = settings.get("containerInsights", "disabled")
    if mode not in ("enabled", "disabled"):
        raise NotImplementedError(f"containerInsights={mode} is priced differently")
    services, families = d.count("AWS::ECS::Service"), d.count("AWS::ECS::TaskDefinition")
    # With no task there are no task-family series; cluster and service series are counted
    # anyway (an upper bound: AWS does not say whether an empty cluster reports them).
    metrics = CI_CLUSTER + CI_SERVICE * services + (CI_FAMILY * families if _tasks(d) else 0)
    metric = prices.METRIC_MONTH.usd
    return [Line("Container Insights metrics (cluster, service, task family)",
                 f"{metric:g} a metric", metric, metrics if mode == "enabled" else 0,
                 ("AWS::ECS::Cluster",))]  # fmt: skip


def gpu_task_lines(d: Deployment) -> list[Line]:
    """What a running task does on its own: EMF metrics, queue polls, repository polls."""
    tasks = _tasks(d)
    service, collector = d.gpu.properties("TaskDefinition")["ContainerDefinitions"][:2]
    env = {e["Name"]: e["Value"] for e in service["Environment"]}
    selectors = re.search(r"metric_name_selectors: \[([^\]]*)\]", str(collector["Environment"]))
    emf = len(selectors.group(1).split(",")) if selectors else 0
    every_s = float(env["GPU_REPOSITORY_POLL_SECS"])
    lists = SECONDS / every_s * (1 + MODELS_PUBLISHED)
    receives = SECONDS / 20 if int(env["GPU_ASYNC_CONCURRENCY"]) else 0  # 20 s long polls
    metric = prices.METRIC_MONTH.usd
    sqs, s3 = prices.SQS_MILLION_REQUESTS.usd, prices.S3_THOUSAND_LISTS.usd
    return [
        Line(f"GPU task: its EMF metrics ({emf}, by cluster and service)", f"{metric:g} a metric",
             metric, emf if tasks else 0, _TASK),
        Line("GPU task: async queue polls (20 s long polls)",
             f"{receives:,.0f} × {usd_text(sqs)} / M", receives * sqs / 1e6, tasks, _TASK),
        Line(f"GPU task: model repository polls (every {every_s:g} s, "
             f"{1 + MODELS_PUBLISHED} LISTs each)",
             f"{lists:,.0f} × {usd_text(s3)} / 1,000", lists * s3 / 1000, tasks, _TASK),
    ]  # fmt: skip


def network_lines(d: Deployment) -> list[Line]:
    """NAT gateways, public addresses and the load balancer: billed by the hour."""
    alb = "AWS::ElasticLoadBalancingV2::LoadBalancer"
    return [
        Line("NAT gateway", *_hourly(prices.NAT_GATEWAY_HOUR),
             d.count("AWS::EC2::NatGateway"), ("AWS::EC2::NatGateway",)),
        Line("public IPv4 address (the NAT gateway's Elastic IP)",
             *_hourly(prices.PUBLIC_IPV4_HOUR), d.count("AWS::EC2::EIP"), ("AWS::EC2::EIP",)),
        Line("internal ALB (no LCU at idle)", *_hourly(prices.ALB_HOUR), d.count(alb), (alb,)),
    ]  # fmt: skip


def fixed_lines(d: Deployment) -> list[Line]:
    """Keys, secrets, zones and the dashboard: a flat monthly charge each."""
    items = [
        ("KMS key", prices.KMS_KEY_MONTH, "AWS::KMS::Key"),
        ("Secrets Manager secret", prices.SECRET_MONTH, "AWS::SecretsManager::Secret"),
        ("private hosted zone (the gRPC name, with GrpcDomainName)", prices.HOSTED_ZONE_MONTH,
         "AWS::Route53::HostedZone"),
        ("dashboard", prices.DASHBOARD_MONTH, "AWS::CloudWatch::Dashboard"),
        ("composite alarm", prices.COMPOSITE_ALARM_MONTH, "AWS::CloudWatch::CompositeAlarm"),
    ]  # fmt: skip
    return [Line(item, f"{usd_text(p.usd)} a {p.unit}", p.usd, d.count(kind), (kind,))
            for item, p, kind in items]  # fmt: skip


def alarm_lines(d: Deployment) -> list[Line]:
    """Alarms cost per metric they watch; a Metrics Insights one per metric it analyses."""
    standard = insights = 0
    for _, alarm in d.resources("AWS::CloudWatch::Alarm"):
        props, metrics = alarm["Properties"], alarm["Properties"].get("Metrics", [])
        insights += sum("SELECT" in str(m.get("Expression", "")) for m in metrics)
        standard += 1 if "MetricName" in props else sum("MetricStat" in m for m in metrics)
    unit, analysed = prices.ALARM_METRIC_MONTH.usd, prices.METRICS_INSIGHTS_ALARM_METRIC_MONTH.usd
    kind = ("AWS::CloudWatch::Alarm",)
    return [
        Line("alarm metrics (standard resolution)", f"{unit:g}", unit, standard, kind),
        Line(f"Metrics Insights alarms (≈ {METRICS_INSIGHTS_METRICS} metrics analysed each)",
             f"{METRICS_INSIGHTS_METRICS} × {analysed:g}", METRICS_INSIGHTS_METRICS * analysed,
             insights, kind),
    ]  # fmt: skip


def lambda_lines(d: Deployment) -> list[Line]:
    """Scheduled invocations (the per-minute drain check) and warm units."""
    request, second = prices.LAMBDA_MILLION_REQUESTS.usd, prices.LAMBDA_GB_SECOND.usd
    lines = [
        Line(f"scheduled invocations ({f.memory_mb} MB function, {DRAIN_CHECK_S * 1000:g} ms "
             "each)",
             f"{f.runs_per_month:,.0f} × ({usd_text(request)} / M + {DRAIN_CHECK_S:g} s × "
             f"{f.memory_mb / 1024:.4g} GB × {usd_text(second)})",
             f.runs_per_month * (request / 1e6 + DRAIN_CHECK_S * f.memory_mb / 1024 * second),
             1, _FUNCTION)
        for f in d.functions if f.runs_per_month
    ]  # fmt: skip
    warm_gb = sum(f.provisioned * f.memory_mb / 1024 for f in d.functions)
    warm = prices.LAMBDA_PROVISIONED_GB_SECOND.usd
    lines.append(Line("provisioned concurrency (GB kept warm; none by default)",
                      f"{usd_text(warm)} × {SECONDS:,} s", warm * SECONDS, warm_gb,
                      ("AWS::Lambda::Alias", "AWS::Lambda::Version")))  # fmt: skip
    return lines


def drain_check_calls(d: Deployment) -> list[Line]:
    """Each drain check queries the keys-only pending index twice (0.5 read unit each) and
    calls GetQueueAttributes once (spillway/fallback/async_drain.py, ``drain_check``)."""
    checks = sum(f.runs_per_month for f in d.functions if f.drain_checks)
    reads, sqs = prices.DYNAMODB_MILLION_READ_UNITS.usd, prices.SQS_MILLION_REQUESTS.usd
    return [Line("drain check: its DynamoDB queries and SQS call",
                 f"{checks:,.0f} × ({usd_text(reads)} + {usd_text(sqs)}) / M",
                 checks * (reads + sqs) / 1e6, 1 if checks else 0, _FUNCTION)]  # fmt: skip


def storage_lines(d: Deployment) -> list[Line]:
    """Logs, images and data at rest."""
    tasks = _tasks(d)
    scheduled = [f for f in d.functions if f.runs_per_month]
    emf = SECONDS / 15 * LOG_BYTES["EMF record"]
    insights = MINUTES * LOG_BYTES["Container Insights minute"]
    checks = sum(f.runs_per_month for f in scheduled)
    gb = (checks * LOG_BYTES["drain check"] + tasks * (emf + insights)) / 1e9 + FLOW_LOG_GB
    ingested, stored = prices.LOGS_INGESTED_GB.usd, prices.LOGS_STORED_GB_MONTH.usd
    metric, ecr = prices.METRIC_MONTH.usd, prices.ECR_GB_MONTH.usd
    filters = len(scheduled) if d.count("AWS::Logs::MetricFilter") else 0
    images = sum(IMAGE_GB.values()) if d.count("AWS::ECR::Repository") else 0
    return [
        Line("logs ingested and kept a month (GB: drain checks, GPU EMF and Container "
             "Insights events, rejected flows)", f"{ingested:g} + {stored:g}",
             ingested + stored, round(gb, 3), ("AWS::Logs::LogGroup", "AWS::EC2::FlowLog")),
        Line(f"cold-start metric of the scheduled function ({COLD_START_HOURS_PER_DAY} h a day)",
             f"{metric:g} × {COLD_START_HOURS_PER_DAY}/24",
             metric * COLD_START_HOURS_PER_DAY / 24, filters, ("AWS::Logs::MetricFilter",)),
        Line("ECR image storage (GB: one GPU and one CPU image)", f"{ecr:g}", ecr, images,
             ("AWS::ECR::Repository",)),
        Line("S3, DynamoDB and SQS at rest (one small model, no records)",
             f"{prices.S3_GB_MONTH.usd:g} / {prices.DYNAMODB_GB_MONTH.usd:g} a GB",
             prices.S3_GB_MONTH.usd, 0,
             ("AWS::S3::Bucket", "AWS::DynamoDB::Table", "AWS::SQS::Queue")),
    ]  # fmt: skip


LINE_BUILDERS: tuple[Callable[[Deployment], list[Line]], ...] = (
    gpu_lines,
    container_insights,
    gpu_task_lines,
    network_lines,
    fixed_lines,
    alarm_lines,
    lambda_lines,
    drain_check_calls,
    storage_lines,
)


def lines(shape: Shape) -> list[Line]:
    """Every idle line of ``shape``."""
    deployment = deploy(shape)
    batch = deployment.infra[3]
    for _, environment in deployment.resources("AWS::Batch::ComputeEnvironment"):
        if int(batch.resolve(environment["Properties"]["ComputeResources"]["MinvCpus"])):
            raise NotImplementedError("a Batch compute environment keeps instances at idle")
    return [line for build in LINE_BUILDERS for line in build(deployment)]
