"""The model repository under an S3 prefix, ``s3://bucket/prefix/<model>/<version>/…``.

A version is committed by its ``SHA256SUMS``, put last; a publish that fails removes what
it uploaded, so it never uses up a number. Versions are downloaded, then verified against
their checksums (``spillway.models.version_files``) before any file is used.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from spillway.aws.objects import get_object_or_none
from spillway.models.config import CHECKSUM_FILE, CONFIG_FILE, ModelConfig
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
    tombstone,
    verify_version_dir,
)
from spillway.protocol.errors import ModelLoadError, ModelNotFoundError
from spillway.protocol.names import MODEL_NAME_PATTERN, validate_model_name, validate_version

DELETE_BATCH = 1000
"""The most keys one S3 ``DeleteObjects`` call takes."""


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

    def _objects(self, model: str) -> dict[str, float]:
        """Every key under the model's prefix (relative to it) and when it was written."""
        prefix = self._key(validate_model_name(model)) + "/"
        found: dict[str, float] = {}
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                found[item["Key"][len(prefix) :]] = item["LastModified"].timestamp()
        return found

    def _numbers(self, model: str, marker: str) -> dict[int, float]:
        """The versions holding ``marker`` (``SHA256SUMS``: committed; ``REMOVED``:
        removed) and when it was written."""
        numbers = {}
        for key, written in self._objects(model).items():
            version, _, name = key.partition("/")
            if name == marker and is_version(version):
                numbers[int(version)] = written
        return numbers

    def list_models(self) -> list[str]:
        root = self._key("") + "/" if self.prefix else ""
        return sorted(n for n in self._children(root) if MODEL_NAME_PATTERN.fullmatch(n))

    def list_versions(self, model: str) -> list[int]:
        # A version exists once its SHA256SUMS (written last) does.
        return sorted(self._numbers(model, CHECKSUM_FILE))

    def read_config(self, model: str) -> ModelConfig:
        return parse_config(self._get(self._key(validate_model_name(model), CONFIG_FILE)), model)

    def publish_version(
        self,
        model: str,
        files: Mapping[str, Path],
        config: ModelConfig | None = None,
        *,
        version: int | None = None,
    ) -> int:
        validate_model_name(model)
        # Numbered after the committed versions (SHA256SUMS, written last, commits one) and
        # the removed ones, so a failed publish never uses up a number (what it uploaded is
        # removed); a number taken is refused before the configuration is written.
        taken = [*self._numbers(model, CHECKSUM_FILE), *self._numbers(model, REMOVED_FILE)]
        version = new_version(model, taken, version)
        if config is not None:
            key = self._key(model, CONFIG_FILE)
            self.client.put_object(Bucket=self.bucket, Key=key, Body=config_bytes(config, model))
        self.read_config(model)
        base = self._key(model, str(version))
        body = checksums_text(files).encode()
        uploaded: list[str] = []
        try:
            for name, source in files.items():
                key = f"{base}/{safe_file_name(name)}"
                uploaded.append(key)
                self.client.upload_file(str(source), self.bucket, key)
            self.client.put_object(Bucket=self.bucket, Key=f"{base}/{CHECKSUM_FILE}", Body=body)
        except BaseException:
            for key in uploaded:
                with contextlib.suppress(Exception):
                    self.client.delete_object(Bucket=self.bucket, Key=key)
            raise
        return version

    def fetch_version(self, model: str, version: int, cache_dir: Path) -> Path:
        config = self.read_config(model)
        base = self._key(model, str(validate_version(version)))
        sums_body = self._get(f"{base}/{CHECKSUM_FILE}")
        if sums_body is None:
            raise ModelNotFoundError(f"model {model!r} has no version {version}")
        sums = parse_checksums(sums_body.decode())
        target = cache_dir / model / str(version)
        cache_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{model}-{version}-", dir=cache_dir))
        try:
            (staging / CHECKSUM_FILE).write_bytes(sums_body)
            for name in sums:
                self.client.download_file(self.bucket, f"{base}/{name}", str(staging / name))
            verify_version_dir(staging, required_files(config))
            shutil.rmtree(target, ignore_errors=True)
            target.parent.mkdir(parents=True, exist_ok=True)
            staging.rename(target)
        except self.client.exceptions.ClientError as exc:
            raise ModelLoadError(f"download of {model} v{version} failed: {exc}") from exc
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target

    # -- managing (``spillway models``) ----------------------------------------------------

    def version_records(self, model: str) -> list[VersionRecord]:
        records = [
            VersionRecord(version, None, removed=removed)
            for version, removed in self._numbers(model, REMOVED_FILE).items()
        ]
        for version, created in self._numbers(model, CHECKSUM_FILE).items():
            body = self._get(self._key(model, str(version), CHECKSUM_FILE)) or b""
            records.append(VersionRecord(version, created, parse_checksums(body.decode())))
        return sorted(records, key=lambda record: record.version)

    def write_config(self, model: str, config: ModelConfig) -> None:
        self.read_config(model)  # an existing model only
        key = self._key(model, CONFIG_FILE)
        self.client.put_object(Bucket=self.bucket, Key=key, Body=config_bytes(config, model))

    def keep_config(self, model: str, version: int, config: ModelConfig) -> None:
        key = self._key(validate_model_name(model), CONFIGS, kept_config_name(version))
        self.client.put_object(Bucket=self.bucket, Key=key, Body=config_bytes(config, model))

    def kept_configs(self, model: str) -> dict[int, ModelConfig]:
        kept: dict[int, ModelConfig] = {}
        for key in self._objects(model):
            folder, _, name = key.partition("/")
            version = kept_version(name) if folder == CONFIGS else None
            if version is not None:
                raw = self._get(self._key(model, CONFIGS, name))
                kept[version] = parse_config(raw, model)
        return kept

    def remove_version(self, model: str, version: int) -> None:
        if validate_version(version) not in self.list_versions(model):
            raise ModelNotFoundError(f"model {model!r} has no version {version}")
        base = self._key(model, str(version))
        keys = [self._key(model, key) for key in self._objects(model)]
        # The tombstone first (the number stays taken), then SHA256SUMS (no reader lists
        # the version any more), then the files.
        self.client.put_object(Bucket=self.bucket, Key=f"{base}/{REMOVED_FILE}", Body=tombstone())
        self._delete([f"{base}/{CHECKSUM_FILE}"])
        files = [k for k in keys if k.startswith(f"{base}/")]
        self._delete(
            [k for k in files if k not in (f"{base}/{REMOVED_FILE}", f"{base}/{CHECKSUM_FILE}")]
        )

    def remove_model(self, model: str) -> None:
        keys = [self._key(model, key) for key in self._objects(model)]
        if not keys:
            raise ModelNotFoundError(f"model {model!r} is not in the repository")
        # Every version uncommitted first: a reader in between sees fewer versions or
        # none, never a version without its files.
        sums = [k for k in keys if k.endswith(f"/{CHECKSUM_FILE}")]
        self._delete(sums)
        self._delete([k for k in keys if k not in sums])

    def _delete(self, keys: list[str]) -> None:
        for start in range(0, len(keys), DELETE_BATCH):
            batch = [{"Key": key} for key in keys[start : start + DELETE_BATCH]]
            answer = self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
            )
            if answer.get("Errors"):
                first = answer["Errors"][0]
                raise ModelLoadError(
                    f"S3 did not delete {first.get('Key')}: {first.get('Code')} "
                    f"{first.get('Message', '')}".rstrip()
                )
