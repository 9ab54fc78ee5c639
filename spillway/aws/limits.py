"""The AWS limits and behaviours the product relies on: one table, each with its source.

Every size, lifetime and rule below is AWS's, with the documentation page it comes from.
The product's own paths stay within them (or refuse clearly), and the local stand-ins
(``spillway_cli.local.websocket``, ``spillway_cli.local.lambda_http``, the local Step Functions and
Batch runners) enforce them as AWS does, with AWS's error or close code, so that what
passes locally passes on the first deploy. ``docs/aws-limits.md`` is generated from this
table (``python -m spillway.aws.limits``) and a test keeps the two equal.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

KB = 1000
KiB = 1024
MiB = 1024 * 1024


@dataclass(frozen=True)
class AwsLimit:
    """One limit or behaviour: its value, what it bounds and the page that says so."""

    service: str
    what: str
    value: int | str
    unit: str
    doc: str


_APIGW_QUOTAS = "https://docs.aws.amazon.com/apigateway/latest/developerguide/limits.html"
_APIGW_WS_QUOTAS = (
    "https://docs.aws.amazon.com/apigateway/latest/developerguide/"
    "apigateway-execution-service-websocket-limits-table.html"
)
_APIGW_WS_BINARY = (
    "https://docs.aws.amazon.com/apigateway/latest/developerguide/"
    "websocket-api-develop-binary-media-types.html"
)
_APIGW_WS_CONNECTIONS = (
    "https://docs.aws.amazon.com/apigateway/latest/developerguide/"
    "apigateway-how-to-call-websocket-api-connections.html"
)
_LAMBDA_QUOTAS = "https://docs.aws.amazon.com/lambda/latest/dg/gettingstarted-limits.html"
_LAMBDA_ENV = "https://docs.aws.amazon.com/lambda/latest/dg/configuration-envvars.html"
_SQS_QUOTAS = (
    "https://docs.aws.amazon.com/AWSSimpleQueueService/latest/SQSDeveloperGuide/"
    "quotas-messages.html"
)
_DDB_QUOTAS = (
    "https://docs.aws.amazon.com/amazondynamodb/latest/developerguide/"
    "ServiceQuotas.html#limits-items"
)
_SFN_QUOTAS = "https://docs.aws.amazon.com/step-functions/latest/dg/service-quotas.html"
_SFN_START = (
    "https://docs.aws.amazon.com/step-functions/latest/apireference/API_StartExecution.html"
)
_S3_LIMITS = "https://docs.aws.amazon.com/AmazonS3/latest/userguide/upload-objects.html"
_S3_KEYS = "https://docs.aws.amazon.com/AmazonS3/latest/userguide/object-keys.html"
_SSM_QUOTAS = "https://docs.aws.amazon.com/general/latest/gr/ssm.html#limits_ssm"
_ALB_GRPC = (
    "https://docs.aws.amazon.com/elasticloadbalancing/latest/application/"
    "load-balancer-target-groups.html#target-group-protocol-version"
)

# --- API Gateway: REST API ---------------------------------------------------------------
REST_PAYLOAD_BYTES = 10 * MiB
"""A REST API request's payload (API Gateway's 10 MB)."""
REST_INTEGRATION_TIMEOUT_S = 29
"""A REST API's integration timeout (the default and the most without a quota increase)."""

# --- API Gateway: WebSocket API ----------------------------------------------------------
WS_FRAME_BYTES = 32 * KiB
"""A WebSocket frame; a message may span frames."""
WS_MESSAGE_BYTES = 128 * KiB
"""A WebSocket message (all its frames); past it the connection is closed with 1009."""
WS_CLOSE_MESSAGE_TOO_BIG = 1009
"""Close code of a message over ``WS_MESSAGE_BYTES``."""
WS_CLOSE_UNSUPPORTED_DATA = 1003
"""Close code of a binary frame: WebSocket APIs take text frames only."""
WS_POST_BYTES = 128 * KiB
"""A message the backend posts to a connection (``@connections``); past it:
``PayloadTooLargeException`` (413)."""
WS_INTEGRATION_TIMEOUT_S = 29
"""A WebSocket route's integration timeout."""
WS_IDLE_TIMEOUT_S = 10 * 60
"""A connection with no traffic for this long is closed."""
WS_CONNECTION_LIFETIME_S = 2 * 60 * 60
"""The longest a connection lives."""
WS_NEW_CONNECTIONS_PER_S = 500
"""New connections a second, per account and Region."""

# --- Lambda ------------------------------------------------------------------------------
LAMBDA_SYNC_PAYLOAD_BYTES = 6 * MiB
"""A synchronous invocation's request and its response (6 MB each)."""
LAMBDA_ASYNC_PAYLOAD_BYTES = 1 * MiB
"""An asynchronous invocation's event (1 MB since October 2025; 256 KB before)."""
LAMBDA_ENV_BYTES = 4 * KiB
"""A function's environment variables, names and values together."""
LAMBDA_TIMEOUT_S = 900
"""The longest a function runs."""

# --- SQS, DynamoDB, Step Functions, S3, SSM, ALB ------------------------------------------
SQS_MESSAGE_BYTES = 1 * MiB
"""An SQS message, body and attributes (1 MiB since August 2025; 256 KiB before)."""
DYNAMODB_ITEM_BYTES = 400 * KiB
"""A DynamoDB item, attribute names and values together."""
SFN_PAYLOAD_BYTES = 256 * KiB
"""A state machine's input, output and each state's data (UTF-8)."""
SFN_EXECUTION_NAME_CHARS = 80
"""A Standard execution's name: 1-80 characters, no whitespace, brackets, wildcards,
punctuation of ``"#%\\^|~`$&,;:/`` or control characters."""
SFN_EXECUTION_NAME_REUSE_DAYS = 90
"""A Standard execution's name stays taken for 90 days after the execution ends: starting
another with the same name is ``ExecutionAlreadyExists`` (unless the input is the same
and the first is still running, which returns the first)."""
S3_PUT_BYTES = 5 * 1024 * MiB
"""One PutObject (5 GB); larger objects need a multipart upload."""
S3_KEY_BYTES = 1024
"""An object key, as UTF-8."""
SSM_STANDARD_VALUE_BYTES = 4 * KiB
"""A Standard-tier SSM parameter's value."""
SSM_ADVANCED_VALUE_BYTES = 8 * KiB
"""An Advanced-tier SSM parameter's value."""
ALB_GRPC = "HTTPS listener + HTTP/2; target group ProtocolVersion GRPC"
"""gRPC through an Application Load Balancer needs an HTTPS listener (a certificate)."""


LIMITS: tuple[AwsLimit, ...] = (
    AwsLimit("API Gateway REST", "request payload", REST_PAYLOAD_BYTES, "bytes", _APIGW_QUOTAS),
    AwsLimit(
        "API Gateway REST",
        "integration timeout",
        REST_INTEGRATION_TIMEOUT_S,
        "s",
        _APIGW_QUOTAS,
    ),
    AwsLimit("API Gateway WebSocket", "frame size", WS_FRAME_BYTES, "bytes", _APIGW_WS_QUOTAS),
    AwsLimit(
        "API Gateway WebSocket",
        "message size (larger: close 1009)",
        WS_MESSAGE_BYTES,
        "bytes",
        _APIGW_WS_QUOTAS,
    ),
    AwsLimit(
        "API Gateway WebSocket",
        "binary frames (close code)",
        WS_CLOSE_UNSUPPORTED_DATA,
        "close code",
        _APIGW_WS_BINARY,
    ),
    AwsLimit(
        "API Gateway WebSocket",
        "@connections post (larger: 413 PayloadTooLargeException)",
        WS_POST_BYTES,
        "bytes",
        _APIGW_WS_CONNECTIONS,
    ),
    AwsLimit(
        "API Gateway WebSocket",
        "integration timeout",
        WS_INTEGRATION_TIMEOUT_S,
        "s",
        _APIGW_WS_QUOTAS,
    ),
    AwsLimit("API Gateway WebSocket", "idle timeout", WS_IDLE_TIMEOUT_S, "s", _APIGW_WS_QUOTAS),
    AwsLimit(
        "API Gateway WebSocket",
        "connection lifetime",
        WS_CONNECTION_LIFETIME_S,
        "s",
        _APIGW_WS_QUOTAS,
    ),
    AwsLimit(
        "API Gateway WebSocket",
        "new connections a second (account, Region)",
        WS_NEW_CONNECTIONS_PER_S,
        "per s",
        _APIGW_WS_QUOTAS,
    ),
    AwsLimit(
        "Lambda",
        "synchronous request and response payload",
        LAMBDA_SYNC_PAYLOAD_BYTES,
        "bytes",
        _LAMBDA_QUOTAS,
    ),
    AwsLimit(
        "Lambda",
        "asynchronous invocation payload",
        LAMBDA_ASYNC_PAYLOAD_BYTES,
        "bytes",
        _LAMBDA_QUOTAS,
    ),
    AwsLimit("Lambda", "environment variables, in all", LAMBDA_ENV_BYTES, "bytes", _LAMBDA_ENV),
    AwsLimit("Lambda", "function timeout", LAMBDA_TIMEOUT_S, "s", _LAMBDA_QUOTAS),
    AwsLimit("SQS", "message size", SQS_MESSAGE_BYTES, "bytes", _SQS_QUOTAS),
    AwsLimit("DynamoDB", "item size", DYNAMODB_ITEM_BYTES, "bytes", _DDB_QUOTAS),
    AwsLimit(
        "Step Functions",
        "input, output and state data",
        SFN_PAYLOAD_BYTES,
        "bytes",
        _SFN_QUOTAS,
    ),
    AwsLimit(
        "Step Functions",
        "execution name length",
        SFN_EXECUTION_NAME_CHARS,
        "characters",
        _SFN_START,
    ),
    AwsLimit(
        "Step Functions",
        "execution name reuse (Standard)",
        SFN_EXECUTION_NAME_REUSE_DAYS,
        "days",
        _SFN_START,
    ),
    AwsLimit("S3", "single PUT", S3_PUT_BYTES, "bytes", _S3_LIMITS),
    AwsLimit("S3", "object key (UTF-8)", S3_KEY_BYTES, "bytes", _S3_KEYS),
    AwsLimit(
        "SSM Parameter Store",
        "Standard parameter value",
        SSM_STANDARD_VALUE_BYTES,
        "bytes",
        _SSM_QUOTAS,
    ),
    AwsLimit(
        "SSM Parameter Store",
        "Advanced parameter value",
        SSM_ADVANCED_VALUE_BYTES,
        "bytes",
        _SSM_QUOTAS,
    ),
    AwsLimit("ALB", "gRPC", ALB_GRPC, "", _ALB_GRPC),
)


def markdown() -> str:
    """``docs/aws-limits.md``: the table, as Markdown."""
    lines = [
        "# AWS limits the product relies on",
        "",
        "Generated from `spillway/aws/limits.py` "
        "(`python -m spillway.aws.limits > docs/aws-limits.md`); a test keeps "
        "them equal. The local stand-ins enforce these as AWS does (docs/deploy.md, "
        '"On AWS\'s terms").',
        "",
        "| service | limit | value | source |",
        "|---|---|---|---|",
    ]
    for limit in LIMITS:
        plain = not isinstance(limit.value, int) or limit.unit == "close code"
        value = str(limit.value) if plain else f"{limit.value:,}"
        unit = f" {limit.unit}" if limit.unit else ""
        lines.append(f"| {limit.service} | {limit.what} | {value}{unit} | <{limit.doc}> |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
