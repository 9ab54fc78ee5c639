"""botocore's exceptions, for the code that catches them without importing botocore.

The types are imported on first use (``from spillway.aws.errors import ClientError``
inside a function, or ``aws_errors()``), so a process that never talks to AWS never
imports botocore. ``error_code`` and the predicates read an error's AWS error code.
"""

from __future__ import annotations

from typing import Any

_NAMES = frozenset(
    {
        "BotoCoreError",
        "ClientError",
        "ConnectTimeoutError",
        "ConnectionClosedError",
        "ConnectionError",
        "EndpointConnectionError",
        "NoCredentialsError",
        "NoRegionError",
        "ReadTimeoutError",
    }
)

CONDITION_FAILED = "ConditionalCheckFailedException"
"""The error code of a DynamoDB write whose ``ConditionExpression`` did not hold."""

NOT_FOUND = ("404", "NoSuchKey", "NotFound")
"""S3's error codes of a key that is not there (``HeadObject`` answers a bare 404)."""


def __getattr__(name: str) -> Any:
    """botocore's exception ``name`` (one of ``_NAMES``), imported on first use."""
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import botocore.exceptions

    return getattr(botocore.exceptions, name)


def aws_errors() -> tuple[type[Exception], ...]:
    """Every failure of an AWS call: botocore's own (``BotoCoreError``: no connection, a
    timeout, no credentials) and the service's answers (``ClientError``)."""
    from botocore.exceptions import BotoCoreError, ClientError

    return (BotoCoreError, ClientError)


def error_code(exc: BaseException, default: str = "") -> str:
    """The AWS error code of a ``ClientError`` (``default`` when it names none)."""
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", default))


def http_status(exc: BaseException) -> int | None:
    """The HTTP status of a ``ClientError``'s answer (``None`` when it has none)."""
    response = getattr(exc, "response", None) or {}
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status if isinstance(status, int) else None


def _client_error(exc: BaseException) -> bool:
    from botocore.exceptions import ClientError

    return isinstance(exc, ClientError)


def is_not_found(exc: BaseException) -> bool:
    """Whether an S3 call failed because its key is not there."""
    return _client_error(exc) and error_code(exc) in NOT_FOUND


def is_condition_failed(exc: BaseException) -> bool:
    """Whether a DynamoDB call failed only because its condition did not hold (the
    client's modelled ``ConditionalCheckFailedException`` is a ``ClientError`` too)."""
    return _client_error(exc) and error_code(exc) == CONDITION_FAILED
