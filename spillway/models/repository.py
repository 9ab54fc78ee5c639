"""Model repository access: a local folder or an S3 prefix, ``<model>/<version>/…``.

Names and versions are validated before any path or key is formed, and every file of a
version is checked against its ``SHA256SUMS`` before it is used. A local folder may also
hold a model the way Triton takes one, ``<model>/<version>/model.onnx`` and nothing else:
its configuration is completed from the newest version's graph
(``spillway.models.signature``) and a version without ``SHA256SUMS`` is served as found.
AWS clients honour boto3's standard ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_<SERVICE>``
variables, so the same code talks to a local moto server and to AWS.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from spillway.aws.clients import aws_client
from spillway.aws.objects import get_object_or_none
from spillway.models.config import CHECKSUM_FILE, CONFIG_FILE, ModelConfig
from spillway.protocol.errors import (
    ChecksumMismatchError,
    InvalidInputError,
    InvalidModelNameError,
    ModelLoadError,
    ModelNotFoundError,
)
from spillway.protocol.names import MODEL_NAME_PATTERN, validate_model_name, validate_version
from spillway.protocol.s3urls import is_s3_url, parse_s3_url

log = logging.getLogger("spillway.repository")

_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_CHUNK = 1 << 20
GRAPH_ONLY_FILE = "model.onnx"
"""The one file of a version in a folder without ``config.json`` (Triton's name)."""


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def parse_checksums(text: str) -> dict[str, str]:
    """``SHA256SUMS`` lines (``<hex>  <file>``) as a map; unsafe file names are refused."""
    sums: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        digest, _, name = line.partition("  ")
        name = name.lstrip("*")
        if not re.fullmatch(r"[0-9a-f]{64}", digest) or not _FILE_NAME.fullmatch(name):
            raise ModelLoadError(f"malformed {CHECKSUM_FILE} line {line[:100]!r}")
        sums[name] = digest
    return sums


def verify_version_dir(version_dir: Path, required: tuple[str, ...]) -> None:
    """Every file listed in ``SHA256SUMS`` matches; every required file is listed."""
    sums_path = version_dir / CHECKSUM_FILE
    if not sums_path.is_file():
        raise ModelLoadError(f"{CHECKSUM_FILE} is missing in {version_dir.name}")
    sums = parse_checksums(sums_path.read_text())
    for name in required:
        if name not in sums:
            raise ModelLoadError(f"{name} is not listed in {CHECKSUM_FILE}")
    for name, digest in sums.items():
        path = version_dir / name
        if not path.is_file():
            raise ModelLoadError(f"{name} is missing from version {version_dir.name}")
        if sha256_file(path) != digest:
            raise ChecksumMismatchError(f"{name} does not match its sha256")


def required_files(config: ModelConfig) -> tuple[str, ...]:
    """Files a version of this model cannot serve without (a pipeline's version folder
    holds no model of its own)."""
    if config.is_pipeline:
        return ()
    block = config.spillway
    return (block.onnx_file,) + ((block.tokenizer_file,) if block.tokenizer_file else ())


class ModelRepository(Protocol):
    """Where model configurations and versions live."""

    location: str

    def list_models(self) -> list[str]:
        """Model names, sorted."""

    def list_versions(self, model: str) -> list[int]:
        """A model's versions, ascending."""

    def read_config(self, model: str) -> ModelConfig:
        """A model's configuration."""

    def fetch_version(self, model: str, version: int, cache_dir: Path) -> Path:
        """A verified local folder holding the version's files."""

    def publish_version(
        self,
        model: str,
        files: Mapping[str, Path],
        config: ModelConfig | None = None,
        *,
        version: int | None = None,
    ) -> int:
        """Add the next version (or ``version``, which must be new); ``SHA256SUMS`` is
        written last and commits it."""


class LocalRepository:
    """A repository in a local folder; versions are verified in place."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.location = str(self.root)

    def _model_dir(self, model: str) -> Path:
        path = (self.root / validate_model_name(model)).resolve()
        if path.parent != self.root or not path.is_dir():
            raise ModelNotFoundError(f"model {model!r} is not in the repository")
        return path

    def list_models(self) -> list[str]:
        return sorted(
            p.name
            for p in self.root.iterdir()
            if MODEL_NAME_PATTERN.fullmatch(p.name)
            and p.is_dir()
            and ((p / CONFIG_FILE).is_file() or _graph_only_versions(p))
        )

    def list_versions(self, model: str) -> list[int]:
        model_dir = self._model_dir(model)
        names = [p.name for p in model_dir.iterdir() if (p / CHECKSUM_FILE).is_file()]
        committed = {int(n) for n in names if _is_version(n)}
        if not (model_dir / CONFIG_FILE).is_file():
            committed.update(_graph_only_versions(model_dir))
        return sorted(committed)

    def read_config(self, model: str) -> ModelConfig:
        model_dir = self._model_dir(model)
        path = model_dir / CONFIG_FILE
        if not path.is_file() and (versions := _graph_only_versions(model_dir)):
            return _completed_config(model, model_dir / str(versions[-1]) / GRAPH_ONLY_FILE)
        return _parse_config(path.read_bytes() if path.is_file() else None, model)

    def fetch_version(self, model: str, version: int, cache_dir: Path) -> Path:
        model_dir = self._model_dir(model)
        version_dir = model_dir / str(validate_version(version))
        if not version_dir.is_dir():
            raise ModelNotFoundError(f"model {model!r} has no version {version}")
        graph_only = not (model_dir / CONFIG_FILE).is_file()
        if graph_only and not (version_dir / CHECKSUM_FILE).is_file():
            if not (version_dir / GRAPH_ONLY_FILE).is_file():
                raise ModelNotFoundError(f"model {model!r} has no version {version}")
            log.info("serving %s v%d as found: it has no %s", model, version, CHECKSUM_FILE)
            return version_dir
        verify_version_dir(version_dir, required_files(self.read_config(model)))
        return version_dir

    def publish_version(
        self,
        model: str,
        files: Mapping[str, Path],
        config: ModelConfig | None = None,
        *,
        version: int | None = None,
    ) -> int:
        model_dir = self.root / validate_model_name(model)
        _ensure(model_dir)
        if config is not None:
            _atomic_write(model_dir / CONFIG_FILE, config_bytes(config, model))
        self.read_config(model)
        existing = [int(p.name) for p in model_dir.iterdir() if _is_version(p.name)]
        version = _new_version(model, existing, version)
        # All or nothing: the version is assembled in a hidden folder and renamed into
        # place whole; a failure leaves no folder behind to use up the number.
        staging = Path(tempfile.mkdtemp(prefix=".publish-", dir=model_dir))
        try:
            for name, source in files.items():
                shutil.copyfile(source, staging / _safe_file_name(name))
            (staging / CHECKSUM_FILE).write_text(checksums_text(files))
            staging.rename(model_dir / str(version))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return version


class S3Repository:
    """A repository under ``s3://bucket/prefix``; versions are downloaded, then verified."""

    def __init__(self, bucket: str, prefix: str, client: Any) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.client = client
        self.location = f"s3://{bucket}/{self.prefix}"

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def _children(self, prefix: str) -> list[str]:
        names: list[str] = []
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix, Delimiter="/"):
            names += [
                c["Prefix"][len(prefix) :].rstrip("/") for c in page.get("CommonPrefixes", [])
            ]
        return names

    def _get(self, key: str) -> bytes | None:
        return get_object_or_none(self.client, self.bucket, key)

    def list_models(self) -> list[str]:
        root = self._key("") + "/" if self.prefix else ""
        return sorted(n for n in self._children(root) if MODEL_NAME_PATTERN.fullmatch(n))

    def list_versions(self, model: str) -> list[int]:
        # A version exists once its SHA256SUMS (written last) does.
        prefix = self._key(validate_model_name(model)) + "/"
        versions = set()
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                version, _, name = item["Key"][len(prefix) :].partition("/")
                if name == CHECKSUM_FILE and _is_version(version):
                    versions.add(int(version))
        return sorted(versions)

    def publish_version(
        self,
        model: str,
        files: Mapping[str, Path],
        config: ModelConfig | None = None,
        *,
        version: int | None = None,
    ) -> int:
        validate_model_name(model)
        if config is not None:
            key = self._key(model, CONFIG_FILE)
            self.client.put_object(Bucket=self.bucket, Key=key, Body=config_bytes(config, model))
        self.read_config(model)
        # Numbered after the committed versions (SHA256SUMS, written last, commits one), so
        # a failed publish never uses up a number; what it uploaded is removed.
        version = _new_version(model, self.list_versions(model), version)
        base = self._key(model, str(version))
        body = checksums_text(files).encode()
        uploaded: list[str] = []
        try:
            for name, source in files.items():
                key = f"{base}/{_safe_file_name(name)}"
                uploaded.append(key)
                self.client.upload_file(str(source), self.bucket, key)
            self.client.put_object(Bucket=self.bucket, Key=f"{base}/{CHECKSUM_FILE}", Body=body)
        except BaseException:
            for key in uploaded:
                with contextlib.suppress(Exception):
                    self.client.delete_object(Bucket=self.bucket, Key=key)
            raise
        return version

    def read_config(self, model: str) -> ModelConfig:
        return _parse_config(self._get(self._key(validate_model_name(model), CONFIG_FILE)), model)

    def fetch_version(self, model: str, version: int, cache_dir: Path) -> Path:
        config = self.read_config(model)
        base = self._key(model, str(validate_version(version)))
        sums_body = self._get(f"{base}/{CHECKSUM_FILE}")
        if sums_body is None:
            raise ModelNotFoundError(f"model {model!r} has no version {version}")
        sums = parse_checksums(sums_body.decode())
        target = cache_dir / model / str(version)
        staging = Path(tempfile.mkdtemp(prefix=f".{model}-{version}-", dir=_ensure(cache_dir)))
        try:
            (staging / CHECKSUM_FILE).write_bytes(sums_body)
            for name in sums:
                self.client.download_file(self.bucket, f"{base}/{name}", str(staging / name))
            verify_version_dir(staging, required_files(config))
            shutil.rmtree(target, ignore_errors=True)
            _ensure(target.parent)
            staging.rename(target)
        except self.client.exceptions.ClientError as exc:
            raise ModelLoadError(f"download of {model} v{version} failed: {exc}") from exc
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target


def checksums_text(files: Mapping[str, Path]) -> str:
    """``SHA256SUMS`` content for files (name -> path), sorted by name."""
    return "".join(f"{sha256_file(files[n])}  {_safe_file_name(n)}\n" for n in sorted(files))


def config_bytes(config: ModelConfig, model: str) -> bytes:
    """A model's ``config.json`` content; the name inside must be the model's."""
    if config.name != model:
        raise ModelLoadError(f"config.json names {config.name!r}, expected {model!r}")
    return (config.model_dump_json(indent=2, exclude_none=True) + "\n").encode()


def _new_version(model: str, existing: list[int], wanted: int | None) -> int:
    """The number of a version to publish: ``wanted`` if no version has it, else the next."""
    if wanted is None:
        return max(existing, default=0) + 1
    if validate_version(wanted) in existing:
        raise InvalidInputError(f"model {model!r} already has version {wanted}")
    return wanted


def _safe_file_name(name: str) -> str:
    if not _FILE_NAME.fullmatch(name) or name == CHECKSUM_FILE:
        raise InvalidModelNameError(f"invalid model file name {name[:80]!r}")
    return name


def _atomic_write(path: Path, data: bytes) -> None:
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_bytes(data)
    staging.replace(path)


def _is_version(name: str) -> bool:
    return name.isascii() and name.isdigit() and int(name) > 0


def _ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _graph_only_versions(model_dir: Path) -> list[int]:
    """The versions of a model folder without ``config.json``: those holding a graph."""
    return sorted(
        int(p.name)
        for p in model_dir.iterdir()
        if _is_version(p.name) and (p / GRAPH_ONLY_FILE).is_file()
    )


def _completed_config(model: str, graph: Path) -> ModelConfig:
    """The configuration completed from ``graph``, read again only when the file changes
    (a poll asks every few seconds)."""
    stat = graph.stat()
    return _config_of_graph(model, str(graph), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)
def _config_of_graph(model: str, graph: str, _mtime_ns: int, _size: int) -> ModelConfig:
    # Imported here: reading a graph needs ONNX Runtime, which a router does not load.
    from spillway.models.signature import config_from_signature, read_signature

    config = config_from_signature(model, read_signature(Path(graph)))
    log.info(
        "config of %s completed from its graph: max_batch_size %d", model, config.max_batch_size
    )
    return config


def _parse_config(raw: bytes | None, model: str) -> ModelConfig:
    if raw is None:
        raise ModelNotFoundError(f"model {model!r} is not in the repository")
    try:
        config = ModelConfig.model_validate_json(raw)
    except ValueError as exc:
        raise ModelLoadError(f"config.json of {model!r} is invalid: {exc}") from exc
    if config.name != model:
        raise ModelLoadError(f"config.json names {config.name!r}, expected {model!r}")
    return config


def open_repository(location: str, *, client: Any | None = None) -> ModelRepository:
    """A repository for ``DIR`` or ``s3://bucket/prefix``."""
    if is_s3_url(location):
        try:
            where = parse_s3_url(location)
        except InvalidInputError as exc:  # a setting, not a request: the server's fault
            raise ModelLoadError(f"model repository: {exc.message}") from None
        return S3Repository(where.bucket, where.prefix, client or aws_client("s3"))
    root = Path(location)
    if not root.is_dir():
        raise ModelLoadError(f"model repository {location!r} is not a folder")
    return LocalRepository(root)
