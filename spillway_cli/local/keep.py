"""What a local stack keeps across restarts, in a folder of its own (``spillway up``:
``out/stack/state/``).

moto holds every AWS resource of the stack in its memory, so a stopped stack used to lose
all it had been given. ``StateKeeper`` saves it through the AWS APIs, reading moto as any
client would (whatever moto's version), and puts it back when the stack starts again:

* the S3 objects of the stack's buckets — models and versions added to the repository
  (``spillway models add``), job data and results, async results — each a file named by
  its SHA-256 under ``objects/``; an object the models folder uploaded and nobody changed
  is not copied (the folder uploads it again), and a folder file removed from the
  repository is not uploaded again while it is unchanged in the folder;
* the items of its tables — the live configuration (tenants), canaries, sessions, async
  records, jobs — but the WebSocket connections' items (connections end with the stack)
  and items whose TTL has passed (DynamoDB would delete them);
* the messages its queues still hold (queued async requests);
* the routing policy in force when ``spillway policy apply`` changed it.

It saves when the stack stops, once every part but moto has stopped (nothing writes any
more), and restores when the stack starts, after the folder's upload and the resources'
creation, before any service starts. ``state.json`` is replaced in one step: a stop cut
short, or a start that never finished restoring, leaves the state of the last clean stop.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spillway.state.table import KEY
from spillway.streams.connections import CONNECTION_PREFIX, HELD_PREFIX
from spillway.streams.tenants import TENANT_PREFIX
from spillway.tenancy.directory import CONFIG_KEY

FORMAT = 1
STATE_FILE = "state.json"
OBJECTS = "objects"
ENDED_WITH_THE_STACK = (CONNECTION_PREFIX, HELD_PREFIX, TENANT_PREFIX)
"""State-table items of WebSocket connections and their tenants' counts: they describe
connections that ended with the stack."""
NOT_KEPT = (
    "batch jobs still running (their records stay as they were), "
    "WebSocket connections, async requests in flight at the stop, the scope proof key "
    "(a new one is made); the next start writes over the logs"
)
_BLOB = re.compile(r"^[0-9a-f]{64}$")
_BINARY = "$b64"
_BATCH = 25  # BatchWriteItem's limit
Clients = Callable[[str], Any]
"""A boto3 client of a service (``s3``, ``dynamodb``, ``sqs``), pointed at the stack."""
Stamp = list[int]
"""A folder file's size and modification time (ns): unchanged while both are."""


class KeptStateError(RuntimeError):
    """The kept state cannot be read: ``spillway up --fresh`` starts clean."""


@dataclass(frozen=True)
class Resources:
    """The stack's resources whose contents are kept, by name."""

    buckets: tuple[str, ...]
    repository: tuple[str, str]
    """The bucket and key prefix (``repository/``) the models folder is uploaded to."""
    state_table: str
    async_table: str
    jobs_table: str
    queues: tuple[str, ...]
    """Read in this order: a message our reads move to its dead-letter queue is kept
    there."""

    @property
    def tables(self) -> tuple[str, ...]:
        return (self.state_table, self.async_table, self.jobs_table)


@dataclass
class Kept:
    """What a kept state holds, counted for the lines ``spillway up`` prints."""

    models: set[str] = field(default_factory=set)
    """Models with kept files in the repository (added, or changed since the folder)."""
    versions: set[str] = field(default_factory=set)
    tenants: set[str] = field(default_factory=set)
    canaries: int = 0
    sessions: int = 0
    async_records: int = 0
    jobs: int = 0
    messages: int = 0
    objects: int = 0
    policy: bool = False

    def describe(self) -> str:
        """``1 model (2 versions), 1 tenant, 0 canaries, ...``."""
        parts = [
            f"{_count(len(self.models), 'model')} ({_count(len(self.versions), 'version')})",
            _count(len(self.tenants), "tenant"),
            _count(self.canaries, "canary", "canaries"),
            _count(self.async_records, "async record"),
        ]
        extra = ((self.jobs, "job"), (self.sessions, "session"), (self.messages, "queued message"))
        parts += [_count(n, noun) for n, noun in extra if n]
        parts.append(_count(self.objects, "S3 object"))
        if self.policy:
            parts.append("the policy applied")
        return ", ".join(parts)


def _count(n: int, noun: str, plural: str | None = None) -> str:
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def upload_folder(
    s3: Any, models: Path, repository: tuple[str, str], removed: dict[str, Stamp] | None = None
) -> tuple[dict[str, Stamp], dict[str, Stamp]]:
    """Upload the models folder into the repository, but a file ``removed`` names with
    its stamp (removed from the repository, unchanged in the folder since); the files
    uploaded and left out, each with its stamp."""
    bucket, prefix = repository
    uploaded: dict[str, Stamp] = {}
    left_out: dict[str, Stamp] = {}
    for path in sorted(models.rglob("*")):
        relative = path.relative_to(models).as_posix()
        if not path.is_file() or relative.startswith(".") or "/samples/" in relative:
            continue
        key = f"{prefix}{relative}"
        stat = path.stat()
        stamp = [stat.st_size, stat.st_mtime_ns]
        if (removed or {}).get(key) == stamp:
            left_out[key] = stamp
            continue
        s3.upload_file(str(path), bucket, key)
        uploaded[key] = stamp
    return uploaded, left_out


class StateKeeper:
    """Saves a stack's state into ``folder`` and restores it (the module's docstring).

    At start: ``set_aside`` (``--fresh``), ``load``, ``upload_folder``, ``restore`` (once
    the resources exist), ``started``; at stop: ``save``."""

    def __init__(self, folder: Path, resources: Resources, clients: Clients) -> None:
        self.folder = folder
        self.resources = resources
        self.clients = clients
        self.policy: str | None = None
        """The policy in force when the state was saved (``None``: the checked-in one)."""
        self._document: dict[str, Any] = {}
        self._folder_files: dict[str, Stamp] = {}
        self._restored: set[tuple[str, str]] = set()
        self._at_start: dict[tuple[str, str], str] = {}
        self._ready = False
        self._fresh = False
        self._set_aside: Path | None = None
        self._kept = False

    @property
    def state_file(self) -> Path:
        return self.folder / STATE_FILE

    def set_aside(self) -> Path | None:
        """Start clean: move the kept state to ``<folder>.previous`` (replacing an older
        one); where it went, ``None`` when nothing was kept."""
        if not self.folder.exists():
            return None
        previous = self.folder.with_name(f"{self.folder.name}.previous")
        shutil.rmtree(previous, ignore_errors=True)
        self.folder.rename(previous)
        return previous

    def begin(self, fresh: bool) -> None:
        """Before the folder's upload: set the kept state aside (``fresh``), or read it."""
        self._fresh = fresh
        self._set_aside = self.set_aside() if fresh else None
        self._kept = self.load()

    def put_back(self) -> str:
        """``restore`` what was kept (the resources exist); the line that says what the
        stack starts with."""
        if self._fresh:
            where = f"moved to {self._set_aside}" if self._set_aside else "nothing was kept"
            return f"--fresh: starting clean ({where})"
        if not self._kept:
            return f"nothing kept in {self.folder} yet: starting clean"
        return f"restored {self.restore().describe()} from {self.folder}"

    def load(self) -> bool:
        """Read the kept state; whether there is one (``KeptStateError``: unreadable)."""
        try:
            document = json.loads(self.state_file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return False
        except (OSError, ValueError) as exc:
            raise KeptStateError(
                f"{self.state_file} cannot be read ({exc}): `spillway up --fresh` starts clean"
            ) from None
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            raise KeptStateError(
                f"{self.state_file} is not a state this version keeps: "
                "`spillway up --fresh` starts clean"
            )
        self._document = document
        policy = document.get("policy")
        self.policy = policy if isinstance(policy, str) else None
        return True

    def upload_folder(self, models: Path) -> tuple[int, int]:
        """The models folder into the repository (``upload_folder``); how many files were
        uploaded and left out (removed from the repository, unchanged here)."""
        removed = self._document.get("removed") or {}
        s3 = self.clients("s3")
        uploaded, left_out = upload_folder(s3, models, self.resources.repository, removed)
        self._folder_files = {**uploaded, **left_out}
        return len(uploaded), len(left_out)

    def restore(self) -> Kept:
        """Put the kept objects (over the folder's), items and messages back; what was
        restored. A kept copy of a folder file that changed since is left out: the
        folder's is newer."""
        document = self._document
        s3 = self.clients("s3")
        for bucket, key, entry in self._kept_objects(document):
            base = entry.get("base")
            if base is not None and self._folder_files.get(key, base) != base:
                continue
            extra = {"ContentType": entry.get("content_type"), "Metadata": entry.get("metadata")}
            given = {name: value for name, value in extra.items() if value}
            s3.upload_file(str(self._blob(entry)), bucket, key, ExtraArgs=given or None)
            self._restored.add((bucket, key))
        document["items"] = self._live_items(document)
        dynamodb = self.clients("dynamodb")
        for table, items in document["items"].items():
            if table in self.resources.tables:
                _put_items(dynamodb, table, [decoded(item) for item in items])
        sqs = self.clients("sqs")
        for queue, messages in (document.get("messages") or {}).items():
            if queue not in self.resources.queues:
                continue
            url = sqs.get_queue_url(QueueName=queue)["QueueUrl"]
            for message in messages:
                attributes = decoded(message.get("attributes") or {})
                extra = {"MessageAttributes": attributes} if attributes else {}
                sqs.send_message(QueueUrl=url, MessageBody=message["body"], **extra)
        return self.counted(document)

    def started(self) -> None:
        """The stack is up: note each object's ETag, so that a save copies only what
        changed after, and allow saves (a start cut short never replaces the state)."""
        self._at_start = {(b, k): etag for b, k, etag in self._listing(self.clients("s3"))}
        self._ready = True

    def save(self, policy: str | None) -> Kept | None:
        """Save what the stack holds now, once every part but moto has stopped (its queues
        are read to the end); ``None`` when the stack never finished starting (the kept
        state stays as it was)."""
        if not self._ready:
            return None
        (self.folder / OBJECTS).mkdir(parents=True, exist_ok=True)
        previous = self._document.get("objects") or {}
        repository_bucket = self.resources.repository[0]
        s3 = self.clients("s3")
        objects: dict[str, dict[str, Any]] = {}
        listed: set[str] = set()
        for bucket, key, etag in self._listing(s3):
            if bucket == repository_bucket:
                listed.add(key)
            unchanged = self._at_start.get((bucket, key)) == etag
            restored = (bucket, key) in self._restored
            if unchanged and not restored and key in self._folder_files:
                continue  # the folder's file, uploaded again at the next start
            entry = previous.get(bucket, {}).get(key) if unchanged and restored else None
            if entry is None or not self._blob(entry).is_file():
                base = self._folder_files.get(key) if bucket == repository_bucket else None
                entry = self._download(s3, bucket, key, base)
            objects.setdefault(bucket, {})[key] = entry
        items, ttl = self._items()
        document = {
            "format": FORMAT,
            "saved_at": time.time(),
            "objects": objects,
            "removed": {k: s for k, s in self._folder_files.items() if k not in listed},
            "items": items,
            "ttl": ttl,
            "messages": self._messages(),
            "policy": policy,
        }
        partial = self.folder / f".{STATE_FILE}.partial"
        partial.write_text(json.dumps(document, separators=(",", ":")), encoding="utf-8")
        partial.replace(self.state_file)
        self._prune(document)
        self._document = document
        return self.counted(document)

    def counted(self, document: dict[str, Any]) -> Kept:
        """What ``document`` holds, counted."""
        kept = Kept(policy=document.get("policy") is not None)
        bucket, prefix = self.resources.repository
        for key in (document.get("objects") or {}).get(bucket, {}):
            if key.startswith(prefix):
                parts = key[len(prefix) :].split("/")
                kept.models.add(parts[0])
                if len(parts) > 2 and parts[1].isdigit():
                    kept.versions.add(f"{parts[0]}/{parts[1]}")
        kept.objects = sum(len(o) for o in (document.get("objects") or {}).values())
        items = document.get("items") or {}
        for item in items.get(self.resources.state_table, []):
            pk = str(item.get(KEY, {}).get("S", ""))
            kept.tenants |= _tenants(item) if pk == CONFIG_KEY else set()
            kept.canaries += pk.startswith("canary#")
            kept.sessions += pk.startswith("session#")
        kept.async_records = len(items.get(self.resources.async_table, []))
        kept.jobs = len(items.get(self.resources.jobs_table, []))
        kept.messages = sum(len(m) for m in (document.get("messages") or {}).values())
        return kept

    def _kept_objects(self, document: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
        for bucket, objects in (document.get("objects") or {}).items():
            if bucket in self.resources.buckets:
                for key, entry in objects.items():
                    yield bucket, key, entry

    def _blob(self, entry: dict[str, Any]) -> Path:
        name = str(entry.get("blob", ""))
        if not _BLOB.fullmatch(name):  # the file is ours, but a path is built from it
            raise KeptStateError(f"{self.state_file} names an object file {name[:80]!r}")
        return self.folder / OBJECTS / name

    def _download(self, s3: Any, bucket: str, key: str, base: Stamp | None) -> dict[str, Any]:
        answer = s3.get_object(Bucket=bucket, Key=key)
        digest = hashlib.sha256()
        partial = self.folder / OBJECTS / f".partial-{uuid.uuid4().hex}"
        with partial.open("wb") as out:
            for chunk in answer["Body"].iter_chunks(1 << 20):
                digest.update(chunk)
                out.write(chunk)
        partial.replace(self.folder / OBJECTS / digest.hexdigest())
        entry: dict[str, Any] = {"blob": digest.hexdigest()}
        if answer.get("ContentType"):
            entry["content_type"] = answer["ContentType"]
        if answer.get("Metadata"):
            entry["metadata"] = answer["Metadata"]
        if base is not None:
            entry["base"] = base
        return entry

    def _listing(self, s3: Any) -> Iterator[tuple[str, str, str]]:
        """Every object of the kept buckets: bucket, key, ETag."""
        present = {b["Name"] for b in s3.list_buckets().get("Buckets", [])}
        for bucket in self.resources.buckets:
            if bucket not in present:
                continue
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
                for found in page.get("Contents", []):
                    yield bucket, str(found["Key"]), str(found["ETag"])

    def _items(self) -> tuple[dict[str, list[Any]], dict[str, str]]:
        """Each kept table's items (typed, bytes as base64) and its TTL attribute."""
        dynamodb = self.clients("dynamodb")
        present = {
            name
            for page in dynamodb.get_paginator("list_tables").paginate()
            for name in page.get("TableNames", [])
        }
        items: dict[str, list[Any]] = {}
        ttl: dict[str, str] = {}
        for table in self.resources.tables:
            if table not in present:
                continue
            described = dynamodb.describe_time_to_live(TableName=table)
            attribute = described.get("TimeToLiveDescription", {}).get("AttributeName")
            if attribute:
                ttl[table] = str(attribute)
            pages = dynamodb.get_paginator("scan").paginate(TableName=table, ConsistentRead=True)
            items[table] = [
                encoded(item)
                for page in pages
                for item in page.get("Items", [])
                if not str(item.get(KEY, {}).get("S", "")).startswith(ENDED_WITH_THE_STACK)
                and _live(item, attribute, time.time())
            ]
        return items, ttl

    def _live_items(self, document: dict[str, Any]) -> dict[str, list[Any]]:
        """The kept items whose TTL has not passed since (DynamoDB would delete them)."""
        ttl = document.get("ttl") or {}
        return {
            table: [item for item in items if _live(item, ttl.get(table), time.time())]
            for table, items in (document.get("items") or {}).items()
        }

    def _messages(self) -> dict[str, list[dict[str, Any]]]:
        """The messages each kept queue holds, read to the end (the stack has stopped)."""
        sqs = self.clients("sqs")
        present = set(sqs.list_queues().get("QueueUrls", []))
        kept: dict[str, list[dict[str, Any]]] = {}
        for queue in self.resources.queues:
            url = next((u for u in present if u.rsplit("/", 1)[-1] == queue), None)
            if url is None:
                continue
            messages: list[dict[str, Any]] = []
            while got := sqs.receive_message(
                QueueUrl=url,
                MaxNumberOfMessages=10,
                VisibilityTimeout=43200,  # never seen twice by this loop
                WaitTimeSeconds=0,
                MessageAttributeNames=["All"],
            ).get("Messages", []):
                messages += [{"body": m["Body"], "attributes": _attributes(m)} for m in got]
            kept[queue] = messages
        return kept

    def _prune(self, document: dict[str, Any]) -> None:
        """Remove the object files no kept object names (and partial ones)."""
        named = {e["blob"] for objects in document["objects"].values() for e in objects.values()}
        for path in (self.folder / OBJECTS).iterdir():
            if path.name not in named:
                path.unlink(missing_ok=True)


def _live(item: dict[str, Any], ttl_attribute: str | None, now: float) -> bool:
    """Whether a typed item's TTL (epoch seconds) has not passed."""
    value = item.get(ttl_attribute, {}).get("N") if ttl_attribute else None
    return value is None or float(value) > now


def _tenants(item: dict[str, Any]) -> set[str]:
    """The tenants of the live configuration's item (``spillway.state.table`` keeps its
    document as JSON text in ``doc``)."""
    try:
        doc = json.loads(item.get("doc", {}).get("S", "{}"))
    except ValueError:
        return set()
    identities = doc.get("identities") if isinstance(doc, dict) else None
    return {str(t) for t in identities.values()} if isinstance(identities, dict) else set()


def _attributes(message: dict[str, Any]) -> dict[str, Any]:
    """A received message's attributes as ``SendMessage`` takes them."""
    wanted = ("DataType", "StringValue", "BinaryValue")
    attributes: dict[str, Any] = encoded(
        {
            name: {k: v for k, v in value.items() if k in wanted}
            for name, value in (message.get("MessageAttributes") or {}).items()
        }
    )
    return attributes


def _put_items(dynamodb: Any, table: str, items: list[Any]) -> None:
    for start in range(0, len(items), _BATCH):
        requests = [{"PutRequest": {"Item": item}} for item in items[start : start + _BATCH]]
        for _ in range(5):
            answer = dynamodb.batch_write_item(RequestItems={table: requests})
            requests = answer.get("UnprocessedItems", {}).get(table, [])
            if not requests:
                break
        else:
            raise RuntimeError(f"{len(requests)} items were not written back to {table}")


def encoded(value: Any) -> Any:
    """``value`` (typed DynamoDB items, message attributes) as JSON can hold it: bytes as
    ``{"$b64": "..."}``."""
    if isinstance(value, bytes | bytearray):
        return {_BINARY: base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, dict):
        return {str(k): encoded(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [encoded(v) for v in value]
    return value


def decoded(value: Any) -> Any:
    """The reverse of ``encoded``."""
    if isinstance(value, dict):
        if len(value) == 1 and isinstance(value.get(_BINARY), str):
            return base64.b64decode(value[_BINARY])
        return {k: decoded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decoded(v) for v in value]
    return value
