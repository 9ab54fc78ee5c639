"""The demo's canary section: a new digits version built to fail 20 % of its inputs runs
as a 10 % canary; the router sends it its share, keeps every session on one version,
rolls it back on its own, and then refuses requests that pin the rolled-back version.
``scenario_canary`` runs it on a started ``LocalStack``.

Its requests are counted here, apart from the demo's other records: the canary's own
failures are the point of the section, and what must hold is that no session on the
stable version fails.
"""

from __future__ import annotations

import http.client
import json
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from spillway.canary import CanaryState, CanaryStore, RollbackBounds
from spillway.repository import aws_client, open_repository
from spillway.state_table import DynamoStateStore
from spillway_cli.canary_cli import describe
from spillway_cli.modelbuild.faulty import publish_faulty_canary
from spillway_cli.stack import REGION, REPOSITORY, STATE_TABLE, LocalStack

MODEL = "digits"
SESSIONS = 40
BOUNDS = RollbackBounds(window_s=60, min_requests=50)
MAX_REQUESTS = 3000


@dataclass
class CanaryReport:
    """What the section saw."""

    stable: int
    canary: int
    requests: Counter[str] = field(default_factory=Counter)
    session_versions: dict[str, set[str]] = field(default_factory=dict)
    stable_session_failures: int = 0
    rolled_back_after_s: float | None = None
    after_rollback: Counter[str] = field(default_factory=Counter)
    pinned_after_rollback: int | None = None
    state: CanaryState | None = None

    @property
    def ok(self) -> bool:
        """Rolled back, no session switched version, no stable session failed, only the
        stable version served after the rollback, and a request pinning the rolled-back
        version refused (409)."""
        return (
            self.rolled_back_after_s is not None
            and all(len(v) == 1 for v in self.session_versions.values())
            and self.stable_session_failures == 0
            and set(self.after_rollback) == {f"v{self.stable}:200"}
            and self.pinned_after_rollback == 409
        )


def _post(
    port: int, body: bytes, headers: dict[str, str], path: str = f"/v2/models/{MODEL}/infer"
) -> tuple[int, str]:
    """One infer request through the router: its status and the version that answered."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        return response.status, response.getheader("x-spillway-model-version") or "?"
    finally:
        conn.close()


def _session(step: int) -> str | None:
    """Every other request belongs to one of ``SESSIONS`` sessions, in turn."""
    return f"demo-user-{(step // 2) % SESSIONS}" if step % 2 else None


def _body(image: np.ndarray) -> bytes:
    tensor = {"name": "image", "shape": [1, 8, 8], "datatype": "FP32"}
    return json.dumps({"inputs": [{**tensor, "data": image.ravel().tolist()}]}).encode()


def _wait_until_followed(
    port: int, headers: dict[str, str], images: np.ndarray, canary: int, limit_s: float = 30.0
) -> float:
    """Send requests without a session until one is answered by the canary."""
    started = time.monotonic()
    step = 0
    while time.monotonic() - started < limit_s:
        if _post(port, _body(images[step % len(images)]), headers)[1] == str(canary):
            return time.monotonic() - started
        step += 1
    raise RuntimeError(f"the router did not serve v{canary} within {limit_s:.0f} s")


def _load(stack: LocalStack) -> None:
    """Ask the GPU service to load the new version beside the serving one."""
    conn = http.client.HTTPConnection("127.0.0.1", stack.ports.gpu, timeout=120)
    conn.request("POST", f"/v2/repository/models/{MODEL}/load")
    response = conn.getresponse()
    response.read()
    if response.status != 200:
        raise RuntimeError(f"loading {MODEL} answered {response.status}")


def scenario_canary(stack: LocalStack, models: Path, say: Callable[[str], None]) -> CanaryReport:
    """Publish the faulty version as a 10 % canary, send traffic with and without
    sessions until the router rolls it back, then check who is served."""
    images = np.load(models / f"{MODEL}/samples/images.npy", allow_pickle=False)
    images = images.astype(np.float32)
    with tempfile.TemporaryDirectory() as work:
        stable, canary = publish_faulty_canary(
            open_repository(REPOSITORY),
            MODEL,
            share=0.2,
            percent=10,
            workdir=Path(work),
            bounds=BOUNDS,
        )
    _load(stack)
    store = CanaryStore(
        DynamoStateStore(STATE_TABLE, lambda: aws_client("dynamodb", REGION)), time.time
    )
    store.start(MODEL, canary, 10, stable=stable, bounds=BOUNDS)
    say(
        f"\n7. canary: {MODEL} v{canary} (fails 20 % of inputs) published beside v{stable} and "
        f"started at 10 %\n   (spillway models canary --model {MODEL} --version {canary} "
        f"--percent 10; config.json spillway.canary says the same)"
    )
    report = CanaryReport(stable, canary)
    headers = {"Content-Type": "application/json", **stack.router_headers}
    # A router reads the record again within its canary_ttl_s (5 s): sessions that began
    # before it saw the canary would be bound on their next request, so the sessions of
    # this run begin once the router answers from the canary.
    followed_s = _wait_until_followed(stack.ports.router, headers, images, canary)
    say(f"   the router followed the new record after {followed_s:.1f} s")
    started = time.monotonic()
    for step in range(MAX_REQUESTS):
        session = _session(step)
        sent = {**headers, **({"x-spillway-session": session} if session else {})}
        status, version = _post(stack.ports.router, _body(images[step % len(images)]), sent)
        report.requests[f"v{version}:{status}"] += 1
        if session is not None:
            seen = report.session_versions.setdefault(session, set())
            seen.add(version)
            report.stable_session_failures += status != 200 and seen == {str(stable)}
        if step % 25 == 24 and (state := store.load(MODEL)) and state.status == "rolled_back":
            report.rolled_back_after_s = time.monotonic() - started
            break
    for step in range(200):
        session = _session(step)
        sent = {**headers, **({"x-spillway-session": session} if session else {})}
        status, version = _post(stack.ports.router, _body(images[step]), sent)
        report.after_rollback[f"v{version}:{status}"] += 1
    pinned = f"/v2/models/{MODEL}/versions/{canary}/infer"
    report.pinned_after_rollback = _post(stack.ports.router, _body(images[0]), headers, pinned)[0]
    report.state = store.load(MODEL)
    _tell(report, say)
    return report


def _tell(report: CanaryReport, say: Callable[[str], None]) -> None:
    total = sum(report.requests.values())
    on_canary = sum(n for k, n in report.requests.items() if k.startswith(f"v{report.canary}:"))
    failed = sum(n for k, n in report.requests.items() if not k.endswith(":200"))
    failed_canary = sum(
        n
        for k, n in report.requests.items()
        if k.startswith(f"v{report.canary}:") and not k.endswith(":200")
    )
    sticky = sum(len(v) == 1 for v in report.session_versions.values())
    canary_sessions = sum(v == {str(report.canary)} for v in report.session_versions.values())
    say(
        f"   {total} requests: {on_canary} ({on_canary / max(total, 1):.1%}) on the canary, "
        f"{failed} failed ({failed_canary} on the canary); {sticky}/{len(report.session_versions)} "
        f"sessions kept one version ({canary_sessions} on the canary); sessions on "
        f"v{report.stable}: {report.stable_session_failures} failures"
    )
    if report.rolled_back_after_s is None:
        say(f"   the canary was NOT rolled back within {MAX_REQUESTS} requests")
    else:
        say(f"   rolled back automatically {report.rolled_back_after_s:.1f} s after the start")
    after = ", ".join(f"{k} x{n}" for k, n in sorted(report.after_rollback.items()))
    say(f"   then 200 requests (canary sessions included): {after}")
    say(
        f"   a request pinning v{report.canary} (/versions/{report.canary}/infer): "
        f"{report.pinned_after_rollback} (409 version_rolled_back unless the operator runs "
        "spillway models canary --allow-pinned)"
    )
    say("   spillway models status digits:\n" + _indent(describe(report.state, MODEL)))


def _indent(text: str) -> str:
    return "\n".join(f"     {line}" for line in text.splitlines())
