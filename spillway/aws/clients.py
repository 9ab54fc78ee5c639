"""The one factory of boto3 clients: every caller passes the timeouts, retries and pool
size its path needs. Endpoints come from boto3's own variables (``AWS_ENDPOINT_URL`` /
``AWS_ENDPOINT_URL_<SERVICE>``), so the same code talks to a local moto server and to AWS.
"""

from __future__ import annotations

from typing import Any


def config(
    *,
    connect_timeout: float | None = 5,
    read_timeout: float | None = 60,
    max_attempts: int | None = 5,
    total_max_attempts: int | None = None,
    retry_mode: str | None = "standard",
    max_pool_connections: int | None = None,
    tcp_keepalive: bool | None = None,
) -> Any:
    """A botocore ``Config``; an argument left ``None`` is left to botocore (its default,
    or the environment's, e.g. ``AWS_RETRY_MODE`` when ``retry_mode`` is ``None``)."""
    # Imported here to keep boto3 out of the start-up of local-only users.
    from botocore.config import Config

    retries: dict[str, Any] = {}
    if retry_mode is not None:
        retries["mode"] = retry_mode
    if max_attempts is not None:
        retries["max_attempts"] = max_attempts
    if total_max_attempts is not None:
        retries["total_max_attempts"] = total_max_attempts
    options: dict[str, Any] = {
        "connect_timeout": connect_timeout,
        "read_timeout": read_timeout,
        "max_pool_connections": max_pool_connections,
        "tcp_keepalive": tcp_keepalive,
    }
    given = {name: value for name, value in options.items() if value is not None}
    return Config(retries=retries, **given) if retries else Config(**given)


def client(
    service: str,
    *,
    region: str | None = None,
    endpoint_url: str | None = None,
    connect_timeout: float | None = 5,
    read_timeout: float | None = 60,
    max_attempts: int | None = 5,
    total_max_attempts: int | None = None,
    retry_mode: str | None = "standard",
    max_pool_connections: int | None = None,
    tcp_keepalive: bool | None = None,
) -> Any:
    """A boto3 client of ``service`` with the ``Config`` the arguments describe (see
    ``config``); by default standard retries, 5 attempts, 5 s to connect, 60 s to read."""
    import boto3

    made = config(
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        max_attempts=max_attempts,
        total_max_attempts=total_max_attempts,
        retry_mode=retry_mode,
        max_pool_connections=max_pool_connections,
        tcp_keepalive=tcp_keepalive,
    )
    return boto3.client(service, region_name=region, endpoint_url=endpoint_url, config=made)


def aws_client(service: str, region: str | None = None) -> Any:
    """A boto3 client with standard retries (5 attempts, 5 s to connect, 60 s to read)."""
    return client(service, region=region)


def has_region_and_credentials() -> bool:
    """Whether boto3 would find a region and credentials (its own resolution)."""
    import boto3

    session = boto3.session.Session()
    return session.region_name is not None and session.get_credentials() is not None
