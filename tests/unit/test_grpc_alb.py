"""The GPU service's gRPC door on AWS, evaluated offline (``infra/ecs-gpu-service.yaml``).

GIVEN the GPU stack deployed with a certificate for its gRPC listener
THEN the ALB has an HTTPS listener on 8001 forwarding to an HTTP/2 gRPC target group of
the tasks' port 8001, health-checked on ``grpc.health.v1.Health/Check`` expecting gRPC
status 0; the ECS service registers that port; the task serves gRPC there; the security
groups open 8001 from the client group through the ALB to the tasks; and the client group
is the one both application forms give the router. Without a certificate none of the
gRPC resources exist and the service registers its HTTP port alone.
"""

from __future__ import annotations

from typing import Any

from infra.checks.cfn_eval import Stack
from tests.unit.async_calls import gpu_task_env
from tests.unit.stacks import deploy, serverless_config

CERTIFICATE = "arn:aws:acm:us-east-1:123456789012:certificate/0f1e2d3c-4b5a-6978-8a9b-0c1d2e3f4a5b"
GRPC_RESOURCES = (
    "GrpcTargetGroup",
    "GrpcListener",
    "ClientToAlbGrpcEgress",
    "AlbGrpcIngress",
    "AlbToTaskGrpcEgress",
    "TaskGrpcIngress",
)


def _with_grpc() -> Stack:
    return deploy().gpu.with_parameters(GrpcCertificateArn=CERTIFICATE)


def _ports(stack: Stack) -> list[tuple[int, str]]:
    """The ECS service's load balancer entries: container port and target group."""
    entries = stack.properties("Service")["LoadBalancers"]
    assert {e["ContainerName"] for e in entries} == {"gpu-service"}
    return [(int(e["ContainerPort"]), e["TargetGroupArn"]) for e in entries]


def test_the_grpc_target_group_is_http2_grpc_checked_on_the_health_service() -> None:
    gpu = _with_grpc()
    grpc, http = gpu.properties("GrpcTargetGroup"), gpu.properties("TargetGroup")
    assert (grpc["Protocol"], grpc["ProtocolVersion"], int(grpc["Port"])) == ("HTTP", "GRPC", 8001)
    assert grpc["TargetType"] == http["TargetType"] == "ip"
    assert grpc["VpcId"] == http["VpcId"]
    assert grpc["HealthCheckPath"] == "/grpc.health.v1.Health/Check"
    assert grpc["Matcher"] == {"GrpcCode": "0"}
    assert grpc["TargetGroupAttributes"] == http["TargetGroupAttributes"]


def test_the_grpc_listener_is_https_on_8001_with_the_certificate() -> None:
    gpu = _with_grpc()
    listener = gpu.properties("GrpcListener")
    assert (listener["Protocol"], int(listener["Port"])) == ("HTTPS", 8001)
    assert listener["Certificates"] == [{"CertificateArn": CERTIFICATE}]
    assert listener["LoadBalancerArn"] == gpu.ref("LoadBalancer")
    (action,) = listener["DefaultActions"]
    assert action == {"Type": "forward", "TargetGroupArn": gpu.ref("GrpcTargetGroup")}
    # AND the service is created after it (ECS refuses a target group no listener uses)
    assert "GrpcListenerReady" in gpu.resources["Service"]["DependsOn"]
    ready = gpu.resolve(gpu.resources["GrpcListenerReady"]["Metadata"])
    assert ready == {"GrpcListener": gpu.ref("GrpcListener")}
    output = gpu.template["Outputs"]["GrpcAddress"]
    assert gpu.condition(output["Condition"])
    assert gpu.resolve(output["Value"]) == gpu.get_att("LoadBalancer", "DNSName") + ":8001"


def test_the_task_serves_grpc_on_the_port_the_service_registers() -> None:
    gpu = _with_grpc()
    assert _ports(gpu) == [(8000, gpu.ref("TargetGroup")), (8001, gpu.ref("GrpcTargetGroup"))]
    container = gpu.properties("TaskDefinition")["ContainerDefinitions"][0]
    assert [int(m["ContainerPort"]) for m in container["PortMappings"]] == [8000, 8001]
    assert gpu_task_env(gpu)["GPU_GRPC_PORT"] == "8001"


def _rule(stack: Stack, logical: str) -> tuple[str, int, int, str]:
    rule = stack.properties(logical)
    peer = rule.get("SourceSecurityGroupId") or rule["DestinationSecurityGroupId"]
    return rule["GroupId"], int(rule["FromPort"]), int(rule["ToPort"]), peer


def test_8001_is_open_from_the_client_group_through_the_alb_to_the_tasks() -> None:
    gpu = _with_grpc()
    client, alb, task = (gpu.ref(g) for g in ("ClientSecurityGroup", "AlbSecurityGroup",
                                               "TaskSecurityGroup"))  # fmt: skip
    assert _rule(gpu, "ClientToAlbGrpcEgress") == (client, 8001, 8001, alb)
    assert _rule(gpu, "AlbGrpcIngress") == (alb, 8001, 8001, client)
    assert _rule(gpu, "AlbToTaskGrpcEgress") == (alb, 8001, 8001, task)
    assert _rule(gpu, "TaskGrpcIngress") == (task, 8001, 8001, alb)


def test_both_forms_give_the_router_the_group_the_grpc_listener_admits() -> None:
    d = deploy()
    client = _with_grpc().ref("ClientSecurityGroup")
    groups: dict[str, Any] = {
        "sam": d.sam.properties("RouterFunction")["VpcConfig"]["SecurityGroupIds"],
        "sls": d.sls.resolve(serverless_config()["functions"]["router"]["vpc"]["securityGroupIds"]),
    }
    assert groups == {"sam": [client], "sls": [client]}


def test_without_a_certificate_there_is_no_grpc_listener() -> None:
    gpu = deploy().gpu
    assert gpu.parameter("GrpcCertificateArn") == ""
    assert [r for r in GRPC_RESOURCES if gpu.included(r)] == []
    assert _ports(gpu) == [(8000, gpu.ref("TargetGroup"))]
    assert not gpu.condition(gpu.template["Outputs"]["GrpcAddress"]["Condition"])
    # the tasks still serve gRPC (in-VPC clients may reach them another way)
    assert gpu_task_env(gpu)["GPU_GRPC_PORT"] == "8001"
