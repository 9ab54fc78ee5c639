"""``spillway up`` and the ``spillway`` commands as a user runs them: in a folder of its
own, with none of a stack's variables in the environment, each command a process of its
own (tests/e2e/test_user_journey.py)."""

from __future__ import annotations

import http.client
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from spillway_cli.local import stackenv

OWN_PREFIXES = ("AWS_", "ROUTER_", "JOBS_", "ASYNC_", "SPILLWAY_", "CPU_", "GPU_")
UP_S = 300.0


def user_env() -> dict[str, str]:
    """A user's environment: none of a stack's variables."""
    return {k: v for k, v in os.environ.items() if not k.startswith(OWN_PREFIXES)}


def spillway(cwd: Path, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    """``spillway ARGS`` run in ``cwd``: its exit code and output."""
    return subprocess.run(
        [sys.executable, "-m", "spillway_cli.main", *args],
        cwd=cwd,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


class Up:
    """``spillway up`` running in ``folder`` (any free ports, the default router runtime
    unless ``flags`` name one), its output read line by line."""

    def __init__(self, folder: Path, models: Path, *flags: str) -> None:
        argv = [sys.executable, "-m", "spillway_cli.main", "up", "--models", str(models)]
        argv += ["--free-ports", *flags]
        self.folder = folder
        self.proc = subprocess.Popen(
            argv,
            cwd=folder,
            env=user_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._new: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._new.put(line.rstrip("\n"))
        self._new.put(None)

    def wait_for(self, text: str, timeout_s: float = UP_S) -> str:
        """The first line (from the start) containing ``text``; fails, with the output so
        far, when the process ends or ``timeout_s`` passes first."""
        deadline = time.monotonic() + timeout_s
        while (found := next((x for x in self.lines if text in x), None)) is None:
            try:
                line = self._new.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no {text!r} within {timeout_s} s:\n" + "\n".join(self.lines))
            if line is None:
                pytest.fail(f"`spillway up` ended before {text!r}:\n" + "\n".join(self.lines))
            self.lines.append(line)
        return found

    def started(self) -> Up:
        """This stack, once it said it is up."""
        self.wait_for("Ctrl-C stops everything.")
        return self

    @property
    def env_file(self) -> Path:
        return self.folder / "out" / "stack" / "env.json"

    @property
    def env(self) -> dict[str, str]:
        return stackenv.read_stack_env(self.env_file)

    def stop(self) -> str:
        """SIGTERM, as a service manager stops it; its whole output."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=120)
        self.wait_for("Spillway stopped.", timeout_s=10)
        return "\n".join(self.lines)

    def end(self) -> None:
        """Stop it if it still runs (a fixture's or a test's ``finally``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=120)


def call(
    url: str,
    headers: dict[str, str],
    path: str = "/v2",
    body: bytes | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """``GET path``, or ``POST`` with ``body``: the status, headers and body."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("GET" if body is None else "POST", path, body=body, headers=headers)
        answer = conn.getresponse()
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}, answer.read()
    finally:
        conn.close()


def infer_json(
    url: str, headers: dict[str, str], model: str, inputs: list[dict[str, Any]]
) -> tuple[int, dict[str, str], dict[str, Any]]:
    """A JSON infer request: the status, headers and decoded answer."""
    body = json.dumps({"inputs": inputs}).encode()
    json_headers = {**headers, "content-type": "application/json"}
    status, answer_headers, raw = call(url, json_headers, f"/v2/models/{model}/infer", body)
    return status, answer_headers, json.loads(raw)


def last_line(said: str, start: str) -> str:
    return [line for line in said.splitlines() if line.startswith(start)][-1]
