"""Which local stacks run, and where: one stack per folder.

A stack holds an exclusive lock (``flock``) on ``stack.lock`` in its log folder — and on
``<env file>.lock`` beside its stack env file when that lives elsewhere — from before it
starts anything until everything has stopped; the lock file holds the stack's record
(pid, folder, ports, URLs, what it is doing). The kernel drops a lock when its process
ends, however it ends, so the file a killed stack left holds nothing: a second
``spillway up`` in the same folder finds the record only while its stack runs, says so,
and changes nothing. A stack env file that a live process wrote counts too (a stack that
predates the lock).

Each running stack's record is also in a folder of this user's (``REGISTRY``, under the
system's temporary folder), so that ``spillway up`` in another folder can say which stack
holds the ports it wanted. A record whose process has ended is ignored and removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from spillway_cli.local import procs, stackenv

REGISTRY = stackenv.REGISTRY
LOCK_NAME = "stack.lock"
_SHOWN_URLS = {
    "router": "SPILLWAY_ROUTER_URL",
    "dashboard": "SPILLWAY_DASHBOARD_URL",
    "websocket": "SPILLWAY_WEBSOCKET_URL",
    "moto": "AWS_ENDPOINT_URL",
}
"""The URLs a record made from a stack env file shows, and their variables."""


@dataclass(frozen=True)
class StackRecord:
    """A running stack, as another ``spillway up`` sees it."""

    pid: int
    log_dir: str
    env_path: str
    state: str = "starting"
    """``starting``, ``up`` or ``stopping``."""
    ports: dict[str, int] = field(default_factory=dict)
    urls: dict[str, str] = field(default_factory=dict)
    findable: bool = False
    """A ``spillway`` command run in another folder may find this stack (``spillway up``'s
    stacks are; a test's are not)."""

    @classmethod
    def parse(cls, text: str) -> StackRecord | None:
        """The record a lock file or a registry entry holds (``None``: none readable)."""
        try:
            doc = json.loads(text)
            record = cls(
                pid=int(doc["pid"]),
                log_dir=str(doc["log_dir"]),
                env_path=str(doc["env_path"]),
                state=str(doc.get("state", "starting")),
                ports={str(k): int(v) for k, v in dict(doc.get("ports") or {}).items()},
                urls={str(k): str(v) for k, v in dict(doc.get("urls") or {}).items()},
                findable=doc.get("findable") is True,
            )
        except (ValueError, KeyError, TypeError):
            return None
        return record


class StackRunning(RuntimeError):
    """A stack already runs in this folder (or writes this stack env file)."""

    def __init__(self, record: StackRecord | None, where: Path) -> None:
        pid = f"pid {record.pid}" if record else "pid unknown"
        super().__init__(f"a stack is already running in {where} ({pid})")
        self.record = record
        self.where = where


def lock_paths(log_dir: Path, env_path: Path) -> list[Path]:
    """The files a stack of ``log_dir`` writing ``env_path`` locks."""
    paths = [log_dir / LOCK_NAME]
    if env_path.parent.resolve() != log_dir.resolve():
        paths.append(env_path.with_name(f"{env_path.name}.lock"))
    return paths


class Claim:
    """A stack's hold on its folder and its entry in the registry, from ``acquire`` (before
    anything starts) to ``release`` (once everything has stopped)."""

    def __init__(
        self,
        log_dir: Path,
        env_path: Path,
        registry: Path | None = None,
        *,
        findable: bool = False,
    ) -> None:
        self.paths = lock_paths(log_dir, env_path)
        self.registry = registry or REGISTRY
        self.record = StackRecord(
            os.getpid(), str(log_dir.resolve()), str(env_path.resolve()), findable=findable
        )
        self._held: list[IO[str]] = []

    def acquire(self) -> None:
        """Lock the folder; ``StackRunning`` naming the stack that holds it."""
        for path in self.paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle = path.open("a+", encoding="utf-8")  # not emptied: the holder's record
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                self.release()
                raise StackRunning(_read(path), path.parent) from None
            self._held.append(handle)
        self.publish()

    def publish(self, **changes: Any) -> None:
        """Update the record (``state``, ``ports``, ``urls``) where others read it."""
        if not self._held:
            return
        self.record = replace(self.record, **changes)
        text = json.dumps(asdict(self.record))
        for handle in self._held:
            handle.seek(0)
            handle.truncate()
            handle.write(text)
            handle.flush()
        self.registry.mkdir(mode=0o700, parents=True, exist_ok=True)
        partial = self.registry / f".{self._entry().name}.partial"
        partial.write_text(text, encoding="utf-8")
        partial.replace(self._entry())

    def release(self) -> None:
        """Leave the registry and drop the locks (the lock files stay: removing one could
        let two stacks lock two different files of the same name)."""
        if self._held:
            self._entry().unlink(missing_ok=True)
        for handle in self._held:
            handle.close()
        self._held = []

    def _entry(self) -> Path:
        digest = hashlib.sha256(self.record.log_dir.encode()).hexdigest()[:12]
        return self.registry / f"{self.record.pid}-{digest}.json"


def running_in(log_dir: Path, env_path: Path) -> StackRunning | None:
    """The stack that holds ``log_dir`` or writes ``env_path``, if one runs; creates
    nothing."""
    for path in lock_paths(log_dir, env_path):
        if not path.is_file():
            continue
        with path.open("r", encoding="utf-8") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return StackRunning(_read(path), path.parent)
    values = stackenv.read_stack_env(env_path)  # empty unless its process is alive
    if values:
        pid = stackenv.stack_pid(env_path)
        urls = {part: values[name] for part, name in _SHOWN_URLS.items() if name in values}
        record = StackRecord(pid or 0, "", str(env_path), "up", urls=urls)
        return StackRunning(record if pid else None, env_path.parent)
    return None


def holders(ports: Mapping[str, int], registry: Path | None = None) -> dict[str, StackRecord]:
    """For each part whose port (``ports``: part → port) a running stack holds, that
    stack's record."""
    records = _registered(registry or REGISTRY)
    found: dict[str, StackRecord] = {}
    for part, port in ports.items():
        holder = next((r for r in records if port in r.ports.values()), None)
        if holder is not None:
            found[part] = holder
    return found


def _registered(registry: Path) -> list[StackRecord]:
    """The records of the stacks that run; a dead process's entry is removed."""
    records = []
    for path in sorted(registry.glob("*.json")) if registry.is_dir() else []:
        with contextlib.suppress(OSError):
            record = StackRecord.parse(path.read_text(encoding="utf-8"))
            if record is not None and procs.alive(record.pid):
                records.append(record)
            else:
                path.unlink(missing_ok=True)
    return records


def _read(path: Path) -> StackRecord | None:
    try:
        return StackRecord.parse(path.read_text(encoding="utf-8"))
    except OSError:
        return None
