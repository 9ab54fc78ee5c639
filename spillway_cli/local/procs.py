"""Child processes of the local stack and the tests: start, wait healthy, stop by PID."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (somebody else's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # somebody else's process, but it exists
        return True
    return True


def wait_http(
    url: str,
    timeout_s: float,
    proc: subprocess.Popen[bytes] | None = None,
    headers: dict[str, str] | None = None,
) -> None:
    """Wait until ``url`` answers 200; fail early if ``proc`` exits.

    One probe at a time, and a probe the server accepted waits for its answer until the
    deadline: a server that starts its workers on the first request (serverless-offline
    starts one per request it cannot give to an idle one) would otherwise get a new
    request, and start a new worker, every time a slow first answer outlasted a short
    probe timeout, and a loaded machine would never see it come up. A refused connection
    fails at once, and is tried again shortly.
    """
    deadline = time.monotonic() + timeout_s
    while (remaining := deadline - time.monotonic()) > 0:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} was up")
        try:
            request = urllib.request.Request(url, headers=headers or {})  # noqa: S310
            with urllib.request.urlopen(request, timeout=remaining) as response:  # noqa: S310
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} was not healthy within {timeout_s:.0f} s")


def wait_accepting(port: int, timeout_s: float, proc: subprocess.Popen[bytes]) -> None:
    """Wait until ``127.0.0.1:port`` accepts connections (a WebSocket API has no health
    route); fail early if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before port {port} was up")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"port {port} did not accept connections within {timeout_s:.0f} s")


@dataclass
class Child:
    """A started process with its log file."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: int) -> None:
        """Send a signal to this process only (by PID)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM, wait, then SIGKILL if needed; the exit code."""
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            return self.proc.wait(timeout_s)

    def log_tail(self, lines: int = 40) -> str:
        """The end of the process's log, for error messages."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def start(
    name: str,
    argv: list[str],
    log_dir: Path,
    env: dict[str, str] | None = None,
    *,
    own_session: bool = False,
) -> Child:
    """Start a process with output to ``log_dir/<name>.log``; ``own_session``: in a
    session of its own, so that the terminal's Ctrl-C reaches only us (it is stopped by
    PID when we are done with it)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(  # noqa: S603 - argv built by the caller, no shell
            argv,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=own_session,
        )
    return Child(name, proc, log_path)
