"""Object storage for job data: an S3 prefix, or a local folder for development.

A location is ``s3://bucket/prefix/`` or a folder path. Keys are ``/``-separated and
relative to the bucket (S3) or the folder (local). S3 clients come from
``spillway.aws.clients.aws_client``, so ``AWS_ENDPOINT_URL`` points them at moto.

Every object has an ETag: S3's own, or for a local file its size and modification time.
A download given the ETag the plan recorded refuses an object that has changed since.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from spillway.aws.clients import aws_client
from spillway.aws.errors import error_code
from spillway.aws.objects import get_object_or_none, head_object_or_none
from spillway.protocol.errors import InputChangedError, InvalidInputError
from spillway.protocol.s3urls import is_s3_url, parse_s3_url

_CHUNK = 1 << 20  # bytes per read while streaming a download


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object."""

    key: str
    size: int
    etag: str


class ObjectStore(Protocol):
    """The few object operations a job needs."""

    def url(self, key: str) -> str:
        """The location of ``key`` as users write it."""

    def list_objects(self, prefix: str) -> list[ObjectInfo]:
        """Every object under ``prefix``, sorted by key."""

    def get_bytes(self, key: str) -> bytes | None:
        """An object's content, or ``None`` when there is none."""

    def put_bytes(self, key: str, data: bytes) -> None:
        """Write a small object in one request."""

    def head(self, key: str) -> ObjectInfo | None:
        """An object's size and ETag, or ``None`` when there is none."""

    def download(self, key: str, path: Path, etag: str = "") -> None:
        """Copy an object to a local file; with an ``etag``, only that version of it
        (``InputChangedError`` otherwise)."""

    def upload(self, path: Path, key: str) -> None:
        """Copy a local file to an object (multipart when large)."""

    def copy(self, source: str, target: str) -> None:
        """Server-side copy inside this store."""

    def delete(self, keys: list[str]) -> None:
        """Remove objects; missing ones are ignored."""


class S3Store:
    """Objects in one S3 bucket."""

    def __init__(self, bucket: str, client: Any) -> None:
        self.bucket = bucket
        self.client = client

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def list_objects(self, prefix: str) -> list[ObjectInfo]:
        found: list[ObjectInfo] = []
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
            found += [
                ObjectInfo(o["Key"], int(o["Size"]), str(o.get("ETag", "")).strip('"'))
                for o in page.get("Contents", [])
            ]
        return sorted(found, key=lambda o: o.key)

    def get_bytes(self, key: str) -> bytes | None:
        return get_object_or_none(self.client, self.bucket, key)

    def put_bytes(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data)

    def head(self, key: str) -> ObjectInfo | None:
        meta = head_object_or_none(self.client, self.bucket, key)
        if meta is None:
            return None
        return ObjectInfo(key, int(meta["ContentLength"]), str(meta.get("ETag", "")).strip('"'))

    def download(self, key: str, path: Path, etag: str = "") -> None:
        if not etag:
            self.client.download_file(self.bucket, key, str(path))
            return
        # One GET with IfMatch (the managed download does not accept it): S3 checks the
        # version and streams that version only, whatever is written meanwhile.
        try:
            reply = self.client.get_object(Bucket=self.bucket, Key=key, IfMatch=f'"{etag}"')
        except self.client.exceptions.ClientError as exc:
            if error_code(exc) in ("412", "PreconditionFailed"):
                raise _changed(self.url(key), etag) from None
            raise
        with reply["Body"] as body, path.open("wb") as target:
            shutil.copyfileobj(body, target, _CHUNK)

    def upload(self, path: Path, key: str) -> None:
        self.client.upload_file(str(path), self.bucket, key)

    def copy(self, source: str, target: str) -> None:
        # The managed copy switches to multipart above 5 GB, where CopyObject stops.
        self.client.copy({"Bucket": self.bucket, "Key": source}, self.bucket, target)

    def delete(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):
            chunk = [{"Key": k} for k in keys[start : start + 1000]]
            if chunk:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": chunk})


class LocalStore:
    """Objects as files under a folder (local runs, unit tests). Files are hard-linked
    rather than copied where the file system allows: like S3 objects, they are never
    modified in place, only replaced."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if path != self.root and self.root not in path.parents:
            raise InvalidInputError(f"key {key[:100]!r} leaves the storage folder")
        return path

    def url(self, key: str) -> str:
        return str(self.root / key)

    def list_objects(self, prefix: str) -> list[ObjectInfo]:
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.rglob("*"):
            key = path.relative_to(self.root).as_posix()
            if path.is_file() and key.startswith(prefix):
                found.append(ObjectInfo(key, path.stat().st_size, _local_etag(path)))
        return sorted(found, key=lambda o: o.key)

    def get_bytes(self, key: str) -> bytes | None:
        path = self._path(key)
        return path.read_bytes() if path.is_file() else None

    def _replace(self, key: str, write: Callable[[Path], object]) -> None:
        """Write beside the target, then rename: readers never see half a file, and a
        rewrite gets a new inode (hard-linked copies keep the old content)."""
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.partial")
        staging.unlink(missing_ok=True)
        write(staging)
        staging.replace(path)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._replace(key, lambda staging: staging.write_bytes(data))

    def head(self, key: str) -> ObjectInfo | None:
        path = self._path(key)
        return ObjectInfo(key, path.stat().st_size, _local_etag(path)) if path.is_file() else None

    def download(self, key: str, path: Path, etag: str = "") -> None:
        source = self._path(key)
        if etag and _local_etag(source) != etag:
            raise _changed(self.url(key), etag)
        _link_or_copy(source, path)
        # A hard link shares the inode, a copy must not have raced a rewrite: either way
        # the file now in ``path`` is checked.
        if etag and _local_etag(path if path.samefile(source) else source) != etag:
            path.unlink(missing_ok=True)
            raise _changed(self.url(key), etag)

    def upload(self, path: Path, key: str) -> None:
        # A hard link where possible: the job never writes to a file it has uploaded.
        self._replace(key, lambda staging: _link_or_copy(path, staging))

    def copy(self, source: str, target: str) -> None:
        self._replace(target, lambda staging: _link_or_copy(self._path(source), staging))

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            self._path(key).unlink(missing_ok=True)


def _local_etag(path: Path) -> str:
    """A local file's stand-in for an ETag: files are replaced, not edited in place, and a
    replacement changes the modification time (and usually the size)."""
    stat = path.stat()
    return f"{stat.st_size:x}-{stat.st_mtime_ns:x}"


def _changed(url: str, etag: str) -> InputChangedError:
    return InputChangedError(
        f"{url} changed since the job was planned (ETag {etag!r} expected); "
        "run the new input as a new job with another output prefix"
    )


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system, or links not supported
        shutil.copyfile(source, target)


def open_location(location: str, *, client: Any | None = None) -> tuple[ObjectStore, str]:
    """The store and key prefix for ``s3://bucket/prefix/`` or a local folder; an S3
    prefix is a folder: it ends with ``/`` (or is empty)."""
    if is_s3_url(location):
        where = parse_s3_url(location)
        prefix = where.prefix.strip("/")
        return S3Store(where.bucket, client or aws_client("s3")), f"{prefix}/" if prefix else ""
    if "://" in location:
        raise InvalidInputError(f"unsupported location {location[:200]!r}")
    return LocalStore(Path(location)), ""
