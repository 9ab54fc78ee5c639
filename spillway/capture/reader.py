"""Reading one tenant's capture records back: by model, time range and status.

Only the caller's own area is listed (``layout.Area``), and within a model only the hours
asked for (``StartAfter`` skips the earlier ones; listing stops past ``until``). Each
object is one gzip JSON Lines file; a line that is not a record is counted, not fatal.
"""

from __future__ import annotations

import gzip
import heapq
import re
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from spillway.capture.layout import UNKNOWN_MODEL, Area
from spillway.capture.records import CaptureRecord, parse_record
from spillway.protocol.errors import InvalidInputError

_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_STATUS = re.compile(r"^([1-5])(?:xx|\d\d)$")


def parse_when(value: str, now: datetime) -> datetime:
    """A time as the CLI takes it: ISO 8601 (UTC when it names no zone) or an age before
    ``now`` (``30s``, ``15m``, ``2h``, ``7d``)."""
    text = value.strip()
    relative = _RELATIVE.match(text)
    if relative:
        amount, unit = float(relative[1]), relative[2]
        return now - timedelta(seconds=amount * _UNITS[unit])
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidInputError(
            f"{value[:60]!r} is neither an ISO 8601 time nor an age such as 15m, 2h or 7d"
        ) from None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


@dataclass(frozen=True)
class StatusFilter:
    """Statuses to keep: exact ones (``200``), classes (``4xx``), ``error`` (4xx and 5xx)
    or ``ok`` (below 400); none given: every status."""

    specs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for spec in self.specs:
            if spec.lower() not in ("error", "ok") and not _STATUS.match(spec.lower()):
                raise InvalidInputError(
                    f"status {spec[:20]!r}: give a status (200), a class (4xx) or error/ok"
                )

    def holds(self, status: int) -> bool:
        """Whether ``status`` is kept."""
        if not self.specs:
            return True
        return any(_status_holds(spec.lower(), status) for spec in self.specs)


def _status_holds(spec: str, status: int) -> bool:
    if spec == "error":
        return status >= 400
    if spec == "ok":
        return status < 400
    if spec.endswith("xx"):
        return status // 100 == int(spec[0])
    return status == int(spec)


@dataclass
class Query:
    """Which records to read."""

    models: tuple[str, ...] = ()
    """Only these models (none: every model in the area)."""
    since: datetime | None = None
    until: datetime | None = None
    status: StatusFilter = field(default_factory=StatusFilter)
    limit: int | None = None
    """The most recent ``limit`` records only."""

    def holds(self, record: CaptureRecord) -> bool:
        """Whether ``record`` is one of them (its time and status)."""
        when = record.time if record.time.tzinfo else record.time.replace(tzinfo=UTC)
        if self.since is not None and when < self.since:
            return False
        if self.until is not None and when > self.until:
            return False
        return self.status.holds(record.status)


class CaptureReader:
    """One tenant's capture records under ``root``, read with a boto3 S3 ``client``."""

    def __init__(self, client: Any, root: str, tenant: str | None) -> None:
        self.client = client
        self.tenant = tenant
        self.area = Area.of(root, tenant)
        self.unreadable = 0
        """Lines or objects that held no record."""

    @property
    def location(self) -> str:
        """The area read, as an S3 URL."""
        return f"s3://{self.area.bucket}/{self.area.prefix}"

    def models(self) -> list[str]:
        """The models with records in the area."""
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.area.bucket, Prefix=self.area.prefix, Delimiter="/"
        )
        found = [
            entry["Prefix"][len(self.area.prefix) :].rstrip("/")
            for page in pages
            for entry in page.get("CommonPrefixes", [])
        ]
        return sorted(name for name in found if name)

    def keys(self, model: str, since: datetime | None, until: datetime | None) -> Iterator[str]:
        """The keys of ``model``'s objects whose hour may hold records from ``since`` to
        ``until``, in time order."""
        options: dict[str, Any] = {
            "Bucket": self.area.bucket,
            "Prefix": self.area.model_prefix(model),
        }
        start = self.area.start_after(model, since)
        if start is not None:
            options["StartAfter"] = start
        last = until.astimezone(UTC).replace(minute=0, second=0, microsecond=0) if until else None
        for page in self.client.get_paginator("list_objects_v2").paginate(**options):
            for entry in page.get("Contents", []):
                hour = self.area.key_hour(entry["Key"], model)
                if hour is None:
                    continue
                if last is not None and hour > last:
                    return
                yield entry["Key"]

    def read_object(self, key: str) -> Iterator[CaptureRecord]:
        """The records of one object."""
        body = self.client.get_object(Bucket=self.area.bucket, Key=key)["Body"].read()
        try:
            text = gzip.decompress(body)
        except (OSError, EOFError, zlib.error):
            self.unreadable += 1
            return
        for line in text.splitlines():
            record = parse_record(line)
            if record is None:
                self.unreadable += 1
            else:
                yield record

    def records(self, query: Query) -> list[CaptureRecord]:
        """The records ``query`` asks for, oldest first."""
        # A 404's record lies in the UNKNOWN_MODEL folder whatever model it named.
        folders = (*query.models, UNKNOWN_MODEL) if query.models else tuple(self.models())
        found = (
            record
            for folder in folders
            for key in self.keys(folder, query.since, query.until)
            for record in self.read_object(key)
            # The area is the tenant's alone; a record naming another is never shown.
            if self._filed(record, folder, query.models)
            and record.tenant == self.tenant
            and query.holds(record)
        )
        return newest(found, query.limit)

    @staticmethod
    def _filed(record: CaptureRecord, folder: str, models: tuple[str, ...]) -> bool:
        """Whether ``record`` belongs in ``folder`` (and to the models asked for)."""
        if folder != UNKNOWN_MODEL:
            return record.model == folder
        return record.status == 404 and (not models or record.model in models)


def newest(records: Iterable[CaptureRecord], limit: int | None) -> list[CaptureRecord]:
    """``records`` oldest first, only the most recent ``limit`` when given."""
    if limit is None:
        return sorted(records, key=_time)
    return sorted(heapq.nlargest(limit, records, key=_time), key=_time)


def _time(record: CaptureRecord) -> datetime:
    return record.time if record.time.tzinfo else record.time.replace(tzinfo=UTC)
