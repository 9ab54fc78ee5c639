"""Model repository access: a local folder or an S3 prefix, ``<model>/<version>/…``.

Names and versions are validated before any path or key is formed, and every file of a
version is checked against its ``SHA256SUMS`` before it is used
(``spillway.models.version_files``: a version's files, checksums, number and tombstone). A
local folder may also hold a model the way Triton takes one,
``<model>/<version>/model.onnx`` and nothing else: its configuration is completed from the
newest version's graph (``spillway.models.signature``) and a version without
``SHA256SUMS`` is served as found. The servers read (``ModelRepository``); ``spillway
models`` also manages (``ManagedRepository``). The S3 store is
``spillway.models.s3_repository``'s. AWS clients honour boto3's standard
``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_<SERVICE>`` variables, so the same code talks to
a local moto server and to AWS.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from spillway.aws.clients import aws_client
from spillway.models.config import CHECKSUM_FILE, CONFIG_FILE, ModelConfig
from spillway.models.s3_repository import S3Repository
from spillway.models.version_files import (
    CONFIGS,
    REMOVED_FILE,
    VersionRecord,
    checksums_text,
    config_bytes,
    is_version,
    kept_config_name,
    kept_version,
    new_version,
    parse_checksums,
    parse_config,
    required_files,
    safe_file_name,
    sha256_file,
    tombstone,
    verify_version_dir,
)
from spillway.protocol.errors import InvalidInputError, ModelLoadError, ModelNotFoundError
from spillway.protocol.names import MODEL_NAME_PATTERN, validate_model_name, validate_version
from spillway.protocol.s3urls import is_s3_url, parse_s3_url

__all__ = [
    "GRAPH_ONLY_FILE",
    "LocalRepository",
    "ManagedRepository",
    "ModelRepository",
    "S3Repository",
    "checksums_text",
    "open_repository",
    "parse_checksums",
    "sha256_file",
    "verify_version_dir",
]

log = logging.getLogger("spillway.repository")

GRAPH_ONLY_FILE = "model.onnx"
"""The one file of a version in a folder without ``config.json`` (Triton's name)."""


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


class ManagedRepository(ModelRepository, Protocol):
    """A repository as ``spillway models`` manages it; versions stay immutable."""

    def version_records(self, model: str) -> list[VersionRecord]:
        """Every version number the model has had, committed or removed, ascending."""

    def write_config(self, model: str, config: ModelConfig) -> None:
        """Replace the model's ``config.json`` whole; no version changes."""

    def keep_config(self, model: str, version: int, config: ModelConfig) -> None:
        """Keep ``config`` as the one versions up to ``version`` were served under."""

    def kept_configs(self, model: str) -> dict[int, ModelConfig]:
        """The configurations kept, by the version each was kept for."""

    def remove_version(self, model: str, version: int) -> None:
        """Uncommit a version, then remove its files, leaving its tombstone."""

    def remove_model(self, model: str) -> None:
        """Remove the model: its configurations, its versions and their tombstones."""


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
        committed = {int(n) for n in names if is_version(n)}
        if not (model_dir / CONFIG_FILE).is_file():
            committed.update(_graph_only_versions(model_dir))
        return sorted(committed)

    def read_config(self, model: str) -> ModelConfig:
        model_dir = self._model_dir(model)
        path = model_dir / CONFIG_FILE
        if not path.is_file() and (versions := _graph_only_versions(model_dir)):
            # Imported here: reading a graph needs ONNX Runtime, which a router does not load.
            from spillway.models.signature import completed_config

            return completed_config(model, model_dir / str(versions[-1]) / GRAPH_ONLY_FILE)
        return parse_config(path.read_bytes() if path.is_file() else None, model)

    def fetch_version(self, model: str, version: int, cache_dir: Path) -> Path:
        model_dir = self._model_dir(model)
        version_dir = model_dir / str(validate_version(version))
        if not version_dir.is_dir() or (version_dir / REMOVED_FILE).is_file():
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
        # Every numbered folder counts, a removed version's tombstone included; a number
        # taken is refused before the configuration is written.
        taken = [int(p.name) for p in model_dir.iterdir() if is_version(p.name)]
        version = new_version(model, taken, version)
        if config is not None:
            _atomic_write(model_dir / CONFIG_FILE, config_bytes(config, model))
        self.read_config(model)
        # All or nothing: the version is assembled in a hidden folder and renamed into
        # place whole; a failure leaves no folder behind to use up the number.
        staging = Path(tempfile.mkdtemp(prefix=".publish-", dir=model_dir))
        try:
            for name, source in files.items():
                shutil.copyfile(source, staging / safe_file_name(name))
            (staging / CHECKSUM_FILE).write_text(checksums_text(files))
            staging.rename(model_dir / str(version))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return version

    def version_records(self, model: str) -> list[VersionRecord]:
        records = []
        for path in self._model_dir(model).iterdir():
            sums, graph = path / CHECKSUM_FILE, path / GRAPH_ONLY_FILE
            if not is_version(path.name):
                continue
            if sums.is_file():
                checksums = parse_checksums(sums.read_text())
                records.append(VersionRecord(int(path.name), sums.stat().st_mtime, checksums))
            elif (path / REMOVED_FILE).is_file():
                removed = (path / REMOVED_FILE).stat().st_mtime
                records.append(VersionRecord(int(path.name), None, removed=removed))
            elif graph.is_file():  # a folder of graphs: served as found
                records.append(VersionRecord(int(path.name), graph.stat().st_mtime))
        return sorted(records, key=lambda record: record.version)

    def write_config(self, model: str, config: ModelConfig) -> None:
        _atomic_write(self._model_dir(model) / CONFIG_FILE, config_bytes(config, model))

    def keep_config(self, model: str, version: int, config: ModelConfig) -> None:
        kept = _ensure(self._model_dir(model) / CONFIGS)
        _atomic_write(kept / kept_config_name(version), config_bytes(config, model))

    def kept_configs(self, model: str) -> dict[int, ModelConfig]:
        kept = self._model_dir(model) / CONFIGS
        files = sorted(kept.iterdir()) if kept.is_dir() else []
        return {
            version: parse_config(path.read_bytes(), model)
            for path in files
            if (version := kept_version(path.name)) is not None
        }

    def remove_version(self, model: str, version: int) -> None:
        if validate_version(version) not in self.list_versions(model):
            raise ModelNotFoundError(f"model {model!r} has no version {version}")
        version_dir = self._model_dir(model) / str(version)
        # The tombstone first (the number stays taken), then SHA256SUMS (no reader lists
        # the version any more), then the files.
        (version_dir / REMOVED_FILE).write_text(tombstone())
        (version_dir / CHECKSUM_FILE).unlink(missing_ok=True)
        for path in version_dir.iterdir():
            if path.is_dir():
                shutil.rmtree(path)
            elif path.name != REMOVED_FILE:
                path.unlink()

    def remove_model(self, model: str) -> None:
        model_dir = self._model_dir(model)
        # One rename takes it out of every listing at once; the files go after.
        graveyard = Path(tempfile.mkdtemp(prefix=f".removed-{model}-", dir=self.root))
        model_dir.rename(graveyard / model)
        shutil.rmtree(graveyard)


def _atomic_write(path: Path, data: bytes) -> None:
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_bytes(data)
    staging.replace(path)


def _ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _graph_only_versions(model_dir: Path) -> list[int]:
    """The versions of a model folder without ``config.json``: those holding a graph."""
    return sorted(
        int(p.name)
        for p in model_dir.iterdir()
        if is_version(p.name) and (p / GRAPH_ONLY_FILE).is_file()
    )


def open_repository(location: str, *, client: Any | None = None) -> ManagedRepository:
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
