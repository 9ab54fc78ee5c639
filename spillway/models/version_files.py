"""A version's files: their names, their ``SHA256SUMS``, its number and its record.

A version is ``<model>/<N>/``: its files and ``SHA256SUMS``, written last, which commits
it. Versions are immutable. Removing one leaves its tombstone (``REMOVED``) where its files
were, so that its number never names another version; a rollback writes the model's
``config.json``, never a version's files. Before a model's signature is replaced, the
configuration its versions were served under is kept beside them
(``<model>/configs/<N>.json``: the one of every version up to ``N`` that no earlier record
covers), so that a rollback serves an older version as it was served.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from spillway.models.config import CHECKSUM_FILE, ModelConfig
from spillway.protocol.errors import (
    ChecksumMismatchError,
    InvalidInputError,
    InvalidModelNameError,
    ModelLoadError,
    ModelNotFoundError,
)
from spillway.protocol.names import validate_version

FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
REMOVED_FILE = "REMOVED"
"""A removed version's tombstone: the only file left in its folder (or under its key)."""
CONFIGS = "configs"
"""The folder of a model's kept configurations, ``<N>.json`` each."""
_CHUNK = 1 << 20


@dataclass(frozen=True)
class VersionRecord:
    """What a repository knows of one version number: committed, or removed."""

    version: int
    created: float | None
    """When its ``SHA256SUMS`` was written (seconds since the epoch); ``None`` if unknown."""
    checksums: Mapping[str, str] = field(default_factory=dict)
    """Its files and their sha256, as its ``SHA256SUMS`` lists them."""
    removed: float | None = None
    """When it was removed; ``None`` while it is committed."""


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
        if not re.fullmatch(r"[0-9a-f]{64}", digest) or not FILE_NAME.fullmatch(name):
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


def checksums_text(files: Mapping[str, Path]) -> str:
    """``SHA256SUMS`` content for files (name -> path), sorted by name."""
    return "".join(f"{sha256_file(files[n])}  {safe_file_name(n)}\n" for n in sorted(files))


def required_files(config: ModelConfig) -> tuple[str, ...]:
    """Files a version of this model cannot serve without (a pipeline's version folder
    holds no model of its own)."""
    if config.is_pipeline:
        return ()
    block = config.spillway
    return (block.onnx_file,) + ((block.tokenizer_file,) if block.tokenizer_file else ())


def config_bytes(config: ModelConfig, model: str) -> bytes:
    """A model's ``config.json`` content; the name inside must be the model's."""
    if config.name != model:
        raise ModelLoadError(f"config.json names {config.name!r}, expected {model!r}")
    return (config.model_dump_json(indent=2, exclude_none=True) + "\n").encode()


def parse_config(raw: bytes | None, model: str) -> ModelConfig:
    """A model's ``config.json`` (``raw``; ``None``: there is none), naming the model."""
    if raw is None:
        raise ModelNotFoundError(f"model {model!r} is not in the repository")
    try:
        config = ModelConfig.model_validate_json(raw)
    except ValueError as exc:
        raise ModelLoadError(f"config.json of {model!r} is invalid: {exc}") from exc
    if config.name != model:
        raise ModelLoadError(f"config.json names {config.name!r}, expected {model!r}")
    return config


def kept_config_name(version: int) -> str:
    """The file, in ``CONFIGS``, of the configuration kept for versions up to ``version``."""
    return f"{validate_version(version)}.json"


def kept_version(name: str) -> int | None:
    """The version a file in ``CONFIGS`` is kept for (``None``: not such a file)."""
    stem, dot, suffix = name.partition(".")
    return int(stem) if dot and suffix == "json" and is_version(stem) else None


def new_version(model: str, taken: list[int], wanted: int | None) -> int:
    """The number of a version to publish: ``wanted`` if no version has had it, else the
    one after every number ``taken`` (committed or removed)."""
    if wanted is None:
        return max(taken, default=0) + 1
    if validate_version(wanted) in taken:
        raise InvalidInputError(f"model {model!r} already has version {wanted}")
    return wanted


def safe_file_name(name: str) -> str:
    """``name`` if it may name a file of a version (never the checksum or tombstone)."""
    if not FILE_NAME.fullmatch(name) or name in (CHECKSUM_FILE, REMOVED_FILE):
        raise InvalidModelNameError(f"invalid model file name {name[:80]!r}")
    return name


def is_version(name: str) -> bool:
    """Whether a folder or key segment names a version."""
    return name.isascii() and name.isdigit() and int(name) > 0


def tombstone() -> str:
    """A removed version's tombstone: when it was removed."""
    return time.strftime("removed %Y-%m-%dT%H:%M:%SZ\n", time.gmtime())
