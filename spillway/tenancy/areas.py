"""Where a tenant's data lives in S3: one scheme for every store.

A feature that lets requests name S3 locations gives each tenant an *area*:
``<root>/<scope>/``, the scope being ``spillway.state.table.scope(tenant)`` (a digest, so
no tenant name can reach into another's keys; ``-`` for the anonymous tenant). A
location a request names must lie inside one of the caller's areas; everything else
(another tenant's area, the model repository, another feature's prefix, another bucket)
is ``OutsideTenantAreaError`` (403). Locations are compared as written: S3 keys are
literal, and a ``.``, ``..`` or empty segment is refused outright, so a check and the
key S3 writes can never disagree.
"""

from __future__ import annotations

from collections.abc import Iterable

from spillway.protocol.errors import InvalidInputError, OutsideTenantAreaError
from spillway.protocol.s3urls import parse_s3_url
from spillway.state.table import scope


def folder(url: str) -> str:
    """``s3://bucket/prefix/``: the location as a folder (one trailing ``/``), checked."""
    where = parse_s3_url(url)
    prefix = where.prefix.rstrip("/")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise InvalidInputError(f"{url[:200]!r} has an empty, '.' or '..' path segment")
    return f"s3://{where.bucket}/{prefix}/" if prefix else f"s3://{where.bucket}/"


def area(root: str, tenant: str | None) -> str:
    """The tenant's area under ``root`` (``s3://bucket/prefix``): ``<root>/<scope>/``."""
    return f"{folder(root)}{scope(tenant)}/"


def require_inside(url: str, areas: Iterable[str], what: str) -> str:
    """``url`` as a folder when it lies inside one of ``areas``; ``OutsideTenantAreaError``
    otherwise (the message names the caller's own areas, never anyone else's)."""
    location = folder(url)
    allowed = [folder(a) for a in areas]
    if any(location.startswith(a) for a in allowed):
        return location
    yours = ", ".join(allowed) or "none is configured"
    raise OutsideTenantAreaError(
        f"the {what} location {url[:200]!r} is outside your area ({yours})"
    )
