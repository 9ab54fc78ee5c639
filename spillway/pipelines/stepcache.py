"""The intermediate-result cache of pipeline steps: memory first, then shared storage.

A step marked ``cache`` keeps its outputs under a key made of the caller's tenant scope,
the step model's name, the version that computed them, a digest of that model's
configuration and a sha256 of the step's inputs (names, datatypes, shapes and the wire
bytes of every tensor). A new version is a new key, so an entry made by an older version
is never served, whatever is still stored; entries of retired versions simply age out.

The scope is ``spillway.state.table.scope(tenant)`` (``-`` for an anonymous caller), so
one tenant's entries are never another's hits: a hit (and its speed) tells a caller only
what it sent itself. A step the pipeline declares ``cache_scope: "shared"`` (allowed only
when everything it reads comes from inputs the pipeline declares public) is kept under
``SHARED_SCOPE`` for every caller, and no answer says it was a hit.

Two tiers behind one interface:

* ``MemoryCache``: a bounded LRU in the process (bytes of the stored arrays), for a
  replica's own repeats; thread-safe, never blocking.
* ``SharedCache``: DynamoDB items (an entry's bytes inline up to ``ITEM_BYTES``, else an
  S3 object the item points to), shared by every replica and every deployable, expiring
  with DynamoDB's TTL (``expires_at``; readers skip expired items, as TTL deletes lazily).
  Entries travel in the binary tensor layout of the wire protocol (``spillway.protocol.codec``):
  nothing is pickled. A storage failure is a miss, logged, never a failed request.

``CacheSettings`` come from ``PIPELINE_CACHE_*`` variables, read by each deployable.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from spillway.envsettings import prefixed_values
from spillway.models.processing import Tensors
from spillway.protocol.codec import decode_response, encode_response
from spillway.protocol.datatypes import datatype_of
from spillway.protocol.errors import SpillwayError
from spillway.protocol.s3urls import parse_s3_url
from spillway.protocol.tensors import wire_buffer
from spillway.protocol.wire import TENANT_SCOPE_PATTERN
from spillway.state import dynamo

log = logging.getLogger("spillway.stepcache")

ENV_PREFIX = "PIPELINE_CACHE_"
ITEM_BYTES = 300_000
"""Entries up to this size live inside their DynamoDB item (its limit is 400 KB)."""
_BATCH_GET = 100  # DynamoDB's BatchGetItem limit


class CacheSettings(BaseModel):
    """Where step outputs are cached (``PIPELINE_CACHE_<FIELD>``); the GPU service, the
    CPU fallback and the batch job read the same variables."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mb: float = Field(default=64.0, ge=0)
    """Memory tier per process, in MB of stored arrays (least recently used entries go
    first); 0: no memory tier."""
    table: str | None = None
    """DynamoDB table of the shared tier (key ``key``, TTL attribute ``expires_at``);
    unset: no shared tier."""
    location: str | None = None
    """``s3://bucket/prefix`` for shared entries too big for a DynamoDB item; unset:
    those are kept in memory only."""
    ttl_s: int = Field(default=86_400, ge=60, le=30 * 86_400)
    """How long a shared entry is kept."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> CacheSettings:
        """Settings from ``PIPELINE_CACHE_*`` variables (empty values count as unset)."""
        return cls.model_validate(prefixed_values(cls, ENV_PREFIX, environ))


SHARED_SCOPE = "shared"
"""The key segment of a step shared across tenants: never a tenant's scope (those are
``-`` or 32 hex digits)."""
_SCOPES = (re.compile(TENANT_SCOPE_PATTERN), re.compile(f"^{SHARED_SCOPE}$"))


def cache_key(scope: str, model: str, version: int, config_digest: str, inputs: Tensors) -> str:
    """``<scope>/<model>/<version>/<sha256>``: whose entry it is, the step model, the
    version that computes it and a hash of its configuration and of every input tensor's
    name, type, shape and bytes."""
    if not any(p.fullmatch(scope) for p in _SCOPES):
        raise ValueError(f"{scope!r} is not a tenant scope")
    digest = hashlib.sha256(config_digest.encode())
    for name in sorted(inputs):
        array = inputs[name]
        datatype = datatype_of(array)
        digest.update(f"\0{name}\0{datatype}\0{array.shape}\0".encode())
        digest.update(wire_buffer(array, datatype))
    return f"{scope}/{model}/{version}/{digest.hexdigest()}"


def tensors_size(tensors: Tensors) -> int:
    """Bytes an entry holds (BYTES elements counted by their length)."""
    size = 0
    for array in tensors.values():
        if array.dtype == np.object_:
            size += sum(len(x) for x in array.reshape(-1).tolist()) + 8 * array.size
        else:
            size += array.nbytes
    return size


def _frozen_copy(tensors: Tensors) -> Tensors:
    """Copies that own their memory (a result may be a view into a whole batch) and that
    no reader can change."""
    out: Tensors = {}
    for name, array in tensors.items():
        copy = np.array(array, copy=True)
        copy.flags.writeable = False
        out[name] = copy
    return out


class StepCache(Protocol):
    """A cache of step outputs by key."""

    blocking: bool
    """Whether a call may wait on the network (run it off an event loop)."""

    def get_many(self, keys: Sequence[str]) -> list[Tensors | None]:
        """The entry of each key, or ``None`` (a miss), in order."""

    def put_many(self, entries: Sequence[tuple[str, Tensors]]) -> None:
        """Store entries (a failure to store is logged, never raised)."""


class MemoryCache:
    """A least-recently-used cache bounded by the bytes it holds; thread-safe."""

    blocking = False

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, tuple[Tensors, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get_many(self, keys: Sequence[str]) -> list[Tensors | None]:
        out: list[Tensors | None] = []
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None:
                    self._entries.move_to_end(key)
                out.append(None if entry is None else entry[0])
        return out

    def put_many(self, entries: Sequence[tuple[str, Tensors]]) -> None:
        for key, tensors in entries:
            size = tensors_size(tensors)
            if size > self.max_bytes:
                continue  # one entry may not push out everything else
            stored = _frozen_copy(tensors)
            with self._lock:
                old = self._entries.pop(key, None)
                if old is not None:
                    self.bytes -= old[1]
                self._entries[key] = (stored, size)
                self.bytes += size
                while self.bytes > self.max_bytes:
                    _, (_, dropped) = self._entries.popitem(last=False)
                    self.bytes -= dropped


def encode_entry(tensors: Tensors) -> tuple[bytes, int | None]:
    """An entry in the wire protocol's binary layout: its body and header length."""
    return encode_response("step-cache", None, None, tensors, binary=set(tensors))


def decode_entry(body: bytes, header_length: int | None) -> Tensors:
    """The tensors of an entry ``encode_entry`` wrote."""
    return decode_response(body, header_length)[1]


class SharedCache:
    """Entries in DynamoDB (inline, or pointing to S3 when big), shared by replicas."""

    blocking = True

    def __init__(
        self,
        settings: CacheSettings,
        clients: Callable[[str], Any],
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if settings.table is None:
            raise ValueError("a shared step cache needs PIPELINE_CACHE_TABLE")
        self.table = settings.table
        self.location = parse_s3_url(settings.location) if settings.location else None
        self.ttl_s = settings.ttl_s
        self._clients = clients
        self._clock = clock

    def get_many(self, keys: Sequence[str]) -> list[Tensors | None]:
        from spillway.aws.errors import aws_errors

        failures: tuple[type[Exception], ...] = (*aws_errors(), SpillwayError)
        found: dict[str, Tensors] = {}
        try:
            for start in range(0, len(keys), _BATCH_GET):
                for item in self._batch_get(list(dict.fromkeys(keys[start : start + _BATCH_GET]))):
                    entry = self._entry(item)
                    if entry is not None:
                        found[item["key"]] = entry
        except failures as exc:
            log.warning("shared step cache read failed; counted as misses: %s", exc)
        return [found.get(key) for key in keys]

    def _batch_get(self, keys: list[str]) -> list[dict[str, Any]]:
        """The items of ``keys`` that exist, as Python values."""
        request = {self.table: {"Keys": [dynamo.item({"key": k}) for k in keys]}}
        items: list[dict[str, Any]] = []
        for _ in range(5):  # unprocessed keys are retried a few times, then missed
            answer = self._clients("dynamodb").batch_get_item(RequestItems=request)
            items += answer.get("Responses", {}).get(self.table, [])
            request = answer.get("UnprocessedKeys") or {}
            if not request:
                break
        return [dynamo.plain_item(item) for item in items]

    def _entry(self, item: Mapping[str, Any]) -> Tensors | None:
        if item["expires_at"] < self._clock():
            return None
        length = item.get("header_length")
        if "body" in item:
            return decode_entry(item["body"], length)
        if "object" in item and self.location is not None:
            place = parse_s3_url(item["object"])
            answer = self._clients("s3").get_object(Bucket=place.bucket, Key=place.prefix)
            return decode_entry(answer["Body"].read(), length)
        return None

    def put_many(self, entries: Sequence[tuple[str, Tensors]]) -> None:
        from spillway.aws.errors import aws_errors

        for key, tensors in entries:
            try:
                self._put(key, tensors)
            except aws_errors() as exc:
                log.warning("shared step cache write failed: %s", exc)

    def _put(self, key: str, tensors: Tensors) -> None:
        body, length = encode_entry(tensors)
        item: dict[str, Any] = {
            "key": key,
            "expires_at": int(self._clock() + self.ttl_s),
            "header_length": length,
        }
        if len(body) <= ITEM_BYTES:
            item["body"] = body
        elif self.location is not None:
            object_key = self.location.key(key)
            self._clients("s3").put_object(Bucket=self.location.bucket, Key=object_key, Body=body)
            item["object"] = f"s3://{self.location.bucket}/{object_key}"
        else:
            return
        self._clients("dynamodb").put_item(TableName=self.table, Item=dynamo.item(item))


class TieredCache:
    """Memory first, then the shared tier; a shared hit is kept in memory too."""

    def __init__(self, memory: MemoryCache | None, shared: StepCache | None) -> None:
        self.memory = memory
        self.shared = shared
        self.blocking = shared is not None and shared.blocking

    def get_many(self, keys: Sequence[str]) -> list[Tensors | None]:
        found: list[Tensors | None] = [None] * len(keys)
        if self.memory is not None:
            found = self.memory.get_many(keys)
        missing = [i for i, entry in enumerate(found) if entry is None]
        if self.shared is not None and missing:
            shared = self.shared.get_many([keys[i] for i in missing])
            for i, entry in zip(missing, shared, strict=True):
                found[i] = entry
            if self.memory is not None:
                hits = zip(missing, shared, strict=True)
                self.memory.put_many([(keys[i], e) for i, e in hits if e is not None])
        return found

    def put_many(self, entries: Sequence[tuple[str, Tensors]]) -> None:
        if self.memory is not None:
            self.memory.put_many(entries)
        if self.shared is not None:
            self.shared.put_many(entries)


def open_cache(
    settings: CacheSettings, clients: Callable[[str], Any] | None = None
) -> StepCache | None:
    """The cache these settings describe (``None``: neither tier is configured)."""
    memory = MemoryCache(int(settings.mb * 1e6)) if settings.mb > 0 else None
    shared: StepCache | None = None
    if settings.table is not None:
        if clients is None:
            from spillway.aws.clients import aws_client

            clients = functools.cache(aws_client)  # one client per service, made once
        shared = SharedCache(settings, clients)
    if memory is None and shared is None:
        return None
    return TieredCache(memory, shared)
