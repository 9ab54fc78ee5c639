"""``s3://`` locations: a bucket and a key prefix, read from a URL and checked.

Every place that takes a location (a model repository, a job's input and output, the
async and pipeline staging areas, a tenant's areas) reads it here, so a URL one refuses
is refused by all.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from spillway.protocol.errors import InvalidInputError

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class S3Location:
    """``s3://bucket/prefix``: the prefix has no leading ``/`` and keeps a trailing one."""

    bucket: str
    prefix: str

    @property
    def url(self) -> str:
        """The location as ``s3://bucket/prefix``."""
        return f"s3://{self.bucket}/{self.prefix}"

    def key(self, *parts: str) -> str:
        """A key below the prefix, joined with ``/``."""
        return "/".join(p.strip("/") for p in (self.prefix, *parts) if p.strip("/"))


def is_s3_url(value: str) -> bool:
    """Whether ``value`` is meant as an ``s3://`` location (it may still be invalid)."""
    return value.startswith("s3://")


def parse_s3_url(value: str) -> S3Location:
    """The bucket and prefix of ``s3://bucket[/prefix]``; a bad one is ``InvalidInputError``."""
    if not is_s3_url(value) or "\\" in value or len(value) > 1024:
        raise InvalidInputError(f"{value[:200]!r} is not an s3://bucket/prefix location")
    bucket, _, prefix = value.removeprefix("s3://").partition("/")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise InvalidInputError(f"{value[:200]!r} does not name a valid bucket")
    return S3Location(bucket, prefix.lstrip("/"))
