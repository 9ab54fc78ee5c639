"""wrk as the load generator: a C client with keep-alive connections, so on a small
machine the client takes far less of the CPU than a Python one would, and every server
(the GPU service, the HTTP floor app) is measured by the same client.

Each run POSTs one prepared body over ``concurrency`` connections for a fixed time and
reports requests, errors and latency percentiles as JSON (from wrk's ``done`` hook).
Install it with ``apt-get install wrk`` (Debian/Ubuntu) or ``brew install wrk``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

SCRIPT = """
wrk.method = "POST"
local f = assert(io.open(os.getenv("SPILLWAY_BODY"), "rb"))
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = os.getenv("SPILLWAY_CONTENT_TYPE")
local length = os.getenv("SPILLWAY_HEADER_LENGTH")
if length ~= nil and length ~= "" then
  wrk.headers["Inference-Header-Content-Length"] = length
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '\\n{"requests": %d, "duration_us": %d, "socket_errors": %d, "non2xx": %d, '
      .. '"p50_us": %d, "p99_us": %d}\\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout,
    e.status, latency:percentile(50), latency:percentile(99)))
end
"""


@dataclass(frozen=True)
class Body:
    """One request body and how to send it."""

    data: bytes
    header_length: int | None = None
    content_type: str = "application/json"


@dataclass(frozen=True)
class WrkResult:
    """What one wrk run measured."""

    requests: int
    seconds: float
    errors: int
    p50_ms: float
    p99_ms: float

    @property
    def per_s(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def available() -> bool:
    return shutil.which("wrk") is not None


def start(url: str, body: Body, concurrency: int, seconds: float) -> subprocess.Popen[str]:
    """Start one wrk run (collect it with ``result``); several may run at once."""
    workdir = Path(tempfile.mkdtemp(prefix="spillway-wrk-"))
    (workdir / "post.lua").write_text(SCRIPT)
    (workdir / "body").write_bytes(body.data)
    env = {
        "SPILLWAY_BODY": str(workdir / "body"),
        "SPILLWAY_CONTENT_TYPE": body.content_type,
        "SPILLWAY_HEADER_LENGTH": "" if body.header_length is None else str(body.header_length),
        "PATH": "/usr/local/bin:/usr/bin:/bin",
    }
    argv = [
        shutil.which("wrk") or "wrk",
        "-t1",
        f"-c{concurrency}",
        f"-d{max(1, round(seconds))}s",
        "--timeout",
        "30s",
        "-s",
        str(workdir / "post.lua"),
        url,
    ]
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


def result(proc: subprocess.Popen[str]) -> WrkResult:
    """Wait for a wrk run and parse its summary line."""
    out, _ = proc.communicate()
    line = next((x for x in reversed(out.splitlines()) if x.startswith('{"requests"')), None)
    if line is None:
        raise RuntimeError(f"wrk printed no summary:\n{out}")
    data = json.loads(line)
    return WrkResult(
        requests=data["requests"],
        seconds=data["duration_us"] / 1e6,
        errors=data["socket_errors"] + data["non2xx"],
        p50_ms=data["p50_us"] / 1e3,
        p99_ms=data["p99_us"] / 1e3,
    )


def run(url: str, body: Body, concurrency: int, seconds: float) -> WrkResult:
    """One wrk run to completion."""
    return result(start(url, body, concurrency, seconds))
