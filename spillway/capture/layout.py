"""Where capture objects lie in S3: each tenant's own area, then model, then hour.

``<root>/<scope>/<model>/<YYYY>/<MM>/<DD>/<HH>/<YYYYMMDDTHHMMSSZ>-<uuid>.jsonl.gz``: the
area is ``spillway.tenancy.areas.area(root, tenant)`` (the scope a digest of the tenant,
``-`` for the anonymous one), so no tenant's name can reach another's keys and an IAM
policy or lifecycle rule can name one tenant's prefix. Keys sort by time within a model,
which lets a reader list only the hours it asks for.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from spillway.protocol.s3urls import parse_s3_url
from spillway.tenancy.areas import area

SUFFIX = ".jsonl.gz"
_HOUR = re.compile(r"^(\d{4})/(\d{2})/(\d{2})/(\d{2})/")


UNKNOWN_MODEL = "-"
"""The folder of the records whose model no backend knew (a 404): a client's invented
names never become key prefixes, an object each (as they never become metric
dimensions); the records keep the name asked for."""


def folder_of(model: str, status: int) -> str:
    """The key folder of a record: its model's name, once a backend answered for it."""
    return UNKNOWN_MODEL if status == 404 else model


def hour_of(when: datetime) -> str:
    """``YYYY/MM/DD/HH`` of an aware time, in UTC."""
    return when.astimezone(UTC).strftime("%Y/%m/%d/%H")


@dataclass(frozen=True)
class Area:
    """A tenant's capture area: its bucket and key prefix (ending in ``/``)."""

    bucket: str
    prefix: str

    @classmethod
    def of(cls, root: str, tenant: str | None) -> Area:
        """The area of ``tenant`` under ``root`` (``s3://bucket/prefix``)."""
        where = parse_s3_url(area(root, tenant))
        return cls(where.bucket, where.prefix)

    def model_prefix(self, model: str) -> str:
        """The prefix of one model's objects."""
        return f"{self.prefix}{model}/"

    def object_key(self, model: str, hour: str, written: datetime, name: str) -> str:
        """The key of one object of ``model``'s records of ``hour``, written at ``written``."""
        stamp = written.astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")
        return f"{self.model_prefix(model)}{hour}/{stamp}-{name}{SUFFIX}"

    def key_hour(self, key: str, model: str) -> datetime | None:
        """The hour (UTC) a key's records belong to, or ``None`` for a key of another
        shape."""
        rest = key.removeprefix(self.model_prefix(model))
        match = _HOUR.match(rest) if rest != key else None
        if match is None or not key.endswith(SUFFIX):
            return None
        year, month, day, hour = (int(part) for part in match.groups())
        try:
            return datetime(year, month, day, hour, tzinfo=UTC)
        except ValueError:
            return None

    def start_after(self, model: str, since: datetime | None) -> str | None:
        """A ``StartAfter`` that skips the hours before ``since`` (``None``: from the first)."""
        if since is None:
            return None
        before = since.astimezone(UTC) - timedelta(hours=1)
        return f"{self.model_prefix(model)}{hour_of(before)}/~"
