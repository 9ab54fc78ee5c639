"""`spillway up` serves the local Step Functions endpoint, names it to the router (both
runtimes), prints it beside the other URLs and stops it with the stack."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError, EndpointConnectionError

from spillway_cli.local import procs
from spillway_cli.local.layout import STATE_MACHINES, Ports
from spillway_cli.local.names import REGION
from spillway_cli.local.stack import LocalStack


@pytest.fixture
def stack(tmp_path: Path) -> LocalStack:
    local = LocalStack(tmp_path / "models", tmp_path / "logs", Ports(cpu=procs.free_port()))
    local.ports = local.ports.resolved()
    return local


def _states(stack: LocalStack) -> Any:
    return boto3.client(
        "stepfunctions",
        region_name=REGION,
        endpoint_url=stack.url("states"),
        config=Config(retries={"mode": "standard", "max_attempts": 1}),
    )


def test_the_stack_serves_step_functions_until_it_stops(
    stack: LocalStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "local")
    # WHEN the stack starts its Step Functions endpoint
    stack._step_functions()
    try:
        # THEN it answers Step Functions' API, and the summary prints it
        client = _states(stack)
        with pytest.raises(ClientError) as missing:
            client.describe_execution(executionArn="arn:aws:states:us-east-1:1:execution:x:y")
        assert missing.value.response["Error"]["Code"] == "ExecutionDoesNotExist"
        assert f"states    {stack.url('states')}" in stack.summary()
    finally:
        stack.stop()
    # AND once the stack stops, nothing listens there, and the summary no longer says so
    with pytest.raises(EndpointConnectionError):
        _states(stack).describe_execution(executionArn="arn:aws:states:us-east-1:1:execution:x:y")
    assert stack.url("states") not in stack.summary()


def test_both_router_runtimes_get_the_endpoint_and_the_machines(
    stack: LocalStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    # WSGI: the router's own environment
    env = stack.router_env()
    assert env["AWS_ENDPOINT_URL_SFN"] == stack.url("states")
    assert json.loads(env["ASYNC_STATE_MACHINES"]) == STATE_MACHINES
    # serverless-offline: serverless.yml's parameter on the command line (its local value
    # is "{}"), the endpoint among the AWS_* variables it hands to the handler
    started: dict[str, Any] = {}

    def start(name: str, argv: list[str], log_dir: Path, env: dict[str, str]) -> object:
        started.update(argv=argv, env=env)
        raise RuntimeError("not started here")

    monkeypatch.setattr("spillway_cli.local.serverless_offline.APP_ZIP", Path(__file__))
    monkeypatch.setattr(procs, "start", start)
    with pytest.raises(RuntimeError, match="not started here"):
        stack._router_offline()
    argv, offline_env = started["argv"], started["env"]
    assert f"--param=asyncStateMachines={json.dumps(STATE_MACHINES)}" in argv
    assert offline_env["AWS_ENDPOINT_URL_SFN"] == stack.url("states")
