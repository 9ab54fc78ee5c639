"""Headless Chromium driven over the DevTools protocol, through a pipe.

``--remote-debugging-pipe`` makes Chromium read protocol messages (JSON, each ended by a
NUL byte) on its file descriptor 3 and write them on 4: no port to find, nothing on the
network. The browser is one of our processes, started with a fresh profile and stopped
by PID.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-pipe",
)


class ProtocolError(RuntimeError):
    """A DevTools command answered with an error."""


@dataclass
class Browser:
    """One headless Chromium and one page in it."""

    pid: int
    _write: int
    _read: int
    profile: Path
    events: list[dict[str, Any]] = field(default_factory=list)
    _answers: dict[int, dict[str, Any]] = field(default_factory=dict)
    _next_id: int = 0
    _lock: threading.Condition = field(default_factory=threading.Condition)
    _session: str | None = None

    @classmethod
    def launch(cls, width: int = 1440, height: int = 1100) -> Browser:
        """Start Chromium and open a blank page of ``width`` × ``height`` CSS pixels."""
        to_browser, ours_write = os.pipe()
        ours_read, from_browser = os.pipe()
        profile = Path(tempfile.mkdtemp(prefix="spillway-chromium-"))
        log = os.open(profile / "chromium.log", os.O_WRONLY | os.O_CREAT, 0o600)
        actions = [
            (os.POSIX_SPAWN_DUP2, to_browser, 3),
            (os.POSIX_SPAWN_DUP2, from_browser, 4),
            (os.POSIX_SPAWN_DUP2, log, 1),
            (os.POSIX_SPAWN_DUP2, log, 2),
        ]
        argv = [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "about:blank"]
        pid = os.posix_spawn(CHROMIUM, argv, dict(os.environ), file_actions=actions)
        for fd in (to_browser, from_browser, log):
            os.close(fd)
        browser = cls(pid, ours_write, ours_read, profile)
        threading.Thread(target=browser._reader, name="cdp-reader", daemon=True).start()
        target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        attached = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})
        browser._session = attached["sessionId"]
        for domain in ("Page", "Runtime", "Network"):
            browser.send(f"{domain}.enable")
        browser.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )
        return browser

    def _reader(self) -> None:
        buffer = b""
        while True:
            try:
                chunk = os.read(self._read, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                with self._lock:
                    self._answers[-1] = {"error": {"message": "the browser closed the pipe"}}
                    self._lock.notify_all()
                return
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            with self._lock:
                for raw in messages:
                    message = json.loads(raw)
                    if "id" in message:
                        self._answers[message["id"]] = message
                    else:
                        self.events.append(message)
                self._lock.notify_all()

    def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run one command (on the page once attached) and return its result."""
        with self._lock:
            self._next_id += 1
            ident = self._next_id
        message: dict[str, Any] = {"id": ident, "method": method, "params": params or {}}
        if self._session is not None:
            message["sessionId"] = self._session
        os.write(self._write, json.dumps(message).encode() + b"\0")
        with self._lock:
            if not self._lock.wait_for(lambda: ident in self._answers or -1 in self._answers, 30):
                raise TimeoutError(f"{method}: no answer within 30 s")
            answer = self._answers.pop(ident, None) or self._answers[-1]
        if "error" in answer:
            raise ProtocolError(f"{method}: {answer['error'].get('message')}")
        result: dict[str, Any] = answer.get("result", {})
        return result

    def goto(self, url: str) -> None:
        """Navigate and wait for the new page's load event."""
        with self._lock:
            seen = len(self.events)
        self.send("Page.navigate", {"url": url})

        def loaded() -> bool:
            with self._lock:
                return any(e.get("method") == "Page.loadEventFired" for e in self.events[seen:])

        self.wait_for(loaded, 30)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-serialisable)."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise ProtocolError(f"{expression[:60]}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def wait_for(self, condition: Callable[[], bool], timeout_s: float) -> None:
        """Poll ``condition`` until it holds; ``TimeoutError`` when it never does."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"condition not met within {timeout_s} s")
            time.sleep(0.1)

    def screenshot(self, path: Path) -> Path:
        """Save the whole page as a PNG."""
        shot = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def requested_urls(self) -> list[str]:
        """Every URL the page asked for since it opened."""
        with self._lock:
            events = list(self.events)
        return [
            e["params"]["request"]["url"]
            for e in events
            if e.get("method") == "Network.requestWillBeSent"
        ]

    def exceptions(self) -> list[str]:
        """Uncaught JavaScript exceptions the page raised."""
        with self._lock:
            events = list(self.events)
        return [
            e["params"]["exceptionDetails"].get("text", "")
            + str(e["params"]["exceptionDetails"].get("exception", {}).get("description", ""))
            for e in events
            if e.get("method") == "Runtime.exceptionThrown"
        ]

    def close(self) -> None:
        """Stop the browser (by PID) and remove its profile."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            done, _ = os.waitpid(self.pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        for fd in (self._write, self._read):
            with contextlib.suppress(OSError):
                os.close(fd)
        shutil.rmtree(self.profile, ignore_errors=True)
