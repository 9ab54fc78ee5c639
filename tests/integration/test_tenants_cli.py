"""``spillway tenants`` and ``spillway config`` against a deployed stack (moto in server
mode as AWS): ``--stack`` finds the state table through the stack's
``RouterStateTableName`` output, as it would on AWS, and every change is one write of the
live configuration item the doors read; two tenants, and a bad input is one line."""

from __future__ import annotations

import json
import uuid

import boto3
from typer.testing import CliRunner

from spillway.state.table import DynamoStateStore, create_table
from spillway.tenancy.directory import ConfigWriter, LiveConfigCache, TenantDirectory
from spillway.tenancy.identity import Authenticator
from spillway_cli.main import app

ACME = "arn:aws:iam::123456789012:role/acme-ci"
GLOBEX = "AKIDGLOBEXKEYID"


def _deployed(table: str) -> str:
    """A stack whose outputs name ``table`` as its state table; its name."""
    name = f"spillway-app-{table[-8:]}"
    template = {
        "Resources": {"Topic": {"Type": "AWS::SNS::Topic"}},
        "Outputs": {"RouterStateTableName": {"Value": table}},
    }
    boto3.client("cloudformation").create_stack(StackName=name, TemplateBody=json.dumps(template))
    return name


def test_tenants_through_a_deployed_stacks_outputs(aws_env: str) -> None:
    table = f"state-{uuid.uuid4().hex[:12]}"
    create_table(boto3.client("dynamodb"), table)
    stack = _deployed(table)
    cli = CliRunner()
    # WHEN an operator maps two principals, sets a live setting and removes one
    for args in (
        ["tenants", "add", "--stack", stack, ACME, "acme"],
        ["tenants", "add", "--stack", stack, GLOBEX, "globex"],
        ["config", "set", "--stack", stack, "ROUTER_DEFAULT_DEADLINE_MS", "20000"],
        ["tenants", "remove", "--stack", stack, GLOBEX],
    ):
        done = cli.invoke(app, args)
        assert done.exit_code == 0, done.output
    # THEN the stack's table holds them, as the doors read it
    listed = json.loads(cli.invoke(app, ["tenants", "list", "--stack", stack, "--json"]).output)
    assert listed["identities"] == {ACME: "acme"}
    assert listed["settings"] == {"ROUTER_DEFAULT_DEADLINE_MS": "20000"}
    assert listed["revision"] == 4
    store = DynamoStateStore(table, lambda: boto3.client("dynamodb"))
    callers = Authenticator(TenantDirectory(LiveConfigCache(store, ttl_s=30.0)))
    event = {"requestContext": {"identity": {"userArn": ACME}}}
    assert callers.tenant(event) == "acme"
    assert callers.tenant({"requestContext": {"identity": {"apiKeyId": GLOBEX}}}) == GLOBEX
    assert ConfigWriter(store).read().revision == 4


def test_a_bad_change_is_one_line_and_writes_nothing(aws_env: str) -> None:
    table = f"state-{uuid.uuid4().hex[:12]}"
    create_table(boto3.client("dynamodb"), table)
    cli = CliRunner()
    refused = [
        (["tenants", "add", "--table", table, ACME, "no spaces allowed"], "tenant must be"),
        (["tenants", "remove", "--table", table, ACME], "is not mapped"),
        (["config", "set", "--table", table, "ROUTER_TRUST_TENANT_HINTS", "true"], "live"),
        (["config", "log-level", "--table", table, "LOUD"], "log level must be"),
    ]
    for args, message in refused:
        done = cli.invoke(app, args)
        assert done.exit_code == 1, done.output
        assert message in done.output
        assert "Traceback" not in done.output
    store = DynamoStateStore(table, lambda: boto3.client("dynamodb"))
    assert ConfigWriter(store).read().revision == 0
    missing = cli.invoke(app, ["tenants", "list", "--stack", "no-such-stack"])
    assert missing.exit_code == 1
    assert "Traceback" not in missing.output
