"""What every model builder shares: atomic writes, checksums, config files and reports.

A model is built into a hidden staging directory beside its final place and swapped in
when complete, so a rebuild overwrites the old model and never leaves a half-written
version behind. Hidden names (leading ``.``) never match ``MODEL_NAME_PATTERN``, so a
repository scanner skips staging directories.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from spillway.models.config import CHECKSUM_FILE, CONFIG_FILE, ModelConfig

if TYPE_CHECKING:
    import onnx

logger = logging.getLogger("spillway_cli.modelbuild")

VERSION = "1"
ONNX_FILE = "model.onnx"
_FILE_MODE = 0o644
_DIR_MODE = 0o755
_CHUNK = 1 << 20


@dataclass(frozen=True)
class BuildReport:
    """The outcome of one model build: its ONNX file's size and digest, and checks run."""

    model: str
    size_bytes: int
    sha256: str
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    def summary(self) -> str:
        """One line for the build log."""
        metrics = " ".join(f"{k}={v:.6g}" for k, v in self.metrics.items())
        return (
            f"{self.model}: {ONNX_FILE} {self.size_bytes} bytes sha256={self.sha256[:12]} "
            f"{metrics} in {self.seconds:.1f}s"
        )


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, then rename over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        # mkstemp creates 0600; served files must be readable by the serving user.
        tmp.chmod(_FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Atomically write UTF-8 text."""
    atomic_write_bytes(path, text.encode("utf-8"))


def save_npy(path: Path, array: NDArray[np.generic]) -> None:
    """Atomically write a ``.npy`` file; object arrays are refused (no pickle)."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    atomic_write_bytes(path, buffer.getvalue())


def save_onnx(model: onnx.ModelProto, path: Path) -> None:
    """Check an in-memory ONNX model and write it atomically."""
    import onnx

    onnx.checker.check_model(model, full_check=True)
    atomic_write_bytes(path, model.SerializeToString())


def write_config(model_dir: Path, config: ModelConfig) -> Path:
    """Write ``<model_dir>/config.json`` (indent 2) from a validated ``ModelConfig``."""
    path = model_dir / CONFIG_FILE
    atomic_write_text(path, json.dumps(config.to_json_dict(), indent=2) + "\n")
    return path


def write_checksums(version_dir: Path) -> Path:
    """Write ``SHA256SUMS`` for every other file under ``version_dir``.

    Lines are ``<hex>  <relative path>`` sorted by path, which ``sha256sum -c`` reads.
    """
    files = sorted(
        p.relative_to(version_dir).as_posix()
        for p in version_dir.rglob("*")
        if p.is_file() and p.relative_to(version_dir).as_posix() != CHECKSUM_FILE
    )
    for name in files:
        # sha256sum escapes these; refusing them keeps the file trivially parseable.
        if "\n" in name or "\\" in name:
            raise ValueError(f"file name not allowed in {CHECKSUM_FILE}: {name!r}")
    lines = [f"{sha256_file(version_dir / name)}  {name}\n" for name in files]
    path = version_dir / CHECKSUM_FILE
    atomic_write_text(path, "".join(lines))
    return path


def make_report(
    model: str, version_dir: Path, metrics: dict[str, float], started: float
) -> BuildReport:
    """Describe the version's ONNX file; ``started`` is a ``time.monotonic()`` value."""
    onnx_path = version_dir / ONNX_FILE
    return BuildReport(
        model=model,
        size_bytes=onnx_path.stat().st_size,
        sha256=sha256_file(onnx_path),
        metrics=metrics,
        seconds=time.monotonic() - started,
    )


@contextmanager
def staged_model_dir(out: Path, name: str) -> Iterator[Path]:
    """Yield an empty staging directory; on success it replaces ``out/name``.

    On an exception the staging directory is removed and ``out/name`` is left as it was.
    """
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.staging-", dir=out))
    staging.chmod(_DIR_MODE)
    try:
        yield staging
        _swap_in(staging, out / name)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _swap_in(staging: Path, target: Path) -> None:
    # A directory cannot be os.replace'd over a non-empty one: move the old one aside
    # first, so the window without a model is two renames long.
    old: Path | None = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
        target.rename(old)
    try:
        staging.rename(target)
    except OSError:
        if old is not None:
            old.rename(target)
        raise
    if old is not None:
        shutil.rmtree(old)


def log_report(report: BuildReport) -> None:
    """Log the one-line build result."""
    logger.info("built %s", report.summary())
