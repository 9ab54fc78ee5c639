"""The demo's canary section: a new digits version built to fail 20 % of its inputs runs
as a 10 % canary; the router sends it its share, keeps every session on one version,
rolls it back on its own, and then refuses requests that pin the rolled-back version.
``scenario_canary`` runs it on a started ``LocalStack``.

Its requests are counted here, apart from the demo's other records: the canary's own
failures are the point of the section (``CanaryReport.by_design_failures``, reported
apart from the demo's error totals), and what must hold is what ``CanaryReport.checks``
lists. None of them depends on timing: the rollback is judged on counts (a window longer
than the section), the requests are split at the exact request that rolled the canary
back, and sessions begin, and the checks after the rollback start, only once every
router instance has read the record again (``canary_ttl_s``).
"""

from __future__ import annotations

import http.client
import json
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from spillway.aws.clients import aws_client
from spillway.canary.records import CanaryState, CanaryStore
from spillway.models.canary_spec import RollbackBounds
from spillway.models.repository import open_repository
from spillway.state.table import DynamoStateStore
from spillway_cli.canary_cli import describe
from spillway_cli.console import Check, at_most, equal
from spillway_cli.local.names import REGION, REPOSITORY, STATE_TABLE
from spillway_cli.local.stack import LocalStack
from spillway_cli.modelbuild.faulty import publish_faulty_canary

MODEL = "digits"
SESSIONS = 40
# The guard judges counts, not throughput: a window as long as a record allows keeps every
# canary request of the section in it, however slowly a loaded machine serves them.
BOUNDS = RollbackBounds(window_s=3600, min_requests=50)
MAX_REQUESTS = 3000
AFTER_ROLLBACK = 200
FOLLOW_LIMIT_S = 120.0
"""How long the router may take to answer from a new canary record (it reads the record
again within ``canary_ttl_s``; the rest is a loaded machine's slack)."""
REQUEST_TIMEOUT_S = 60.0


@dataclass
class CanaryReport:
    """What the section saw, split at the rollback: ``running``, ``session_versions`` and
    ``stable_failures`` cover the requests routed while the canary ran (up to and with
    the one that rolled it back), ``after_rollback`` those sent once every router had
    followed the rollback. Counters are keyed ``v<version>:<status>``."""

    stable: int
    canary: int
    followed_after_s: float | None = None
    running: Counter[str] = field(default_factory=Counter)
    session_versions: dict[str, set[str]] = field(default_factory=dict)
    stable_failures: int = 0
    requests_to_rollback: int | None = None
    rolled_back_after_s: float | None = None
    after_rollback: Counter[str] = field(default_factory=Counter)
    pinned_after_rollback: int | None = None
    state: CanaryState | None = None

    @property
    def requests(self) -> Counter[str]:
        """Every infer request of the section (the pinned one aside)."""
        return self.running + self.after_rollback

    @property
    def by_design_failures(self) -> int:
        """Requests the faulty canary failed while it ran: the point of the section, not
        errors (a failure after the rollback fails a check instead)."""
        prefix = f"v{self.canary}:"
        return sum(
            n for k, n in self.running.items() if k.startswith(prefix) and k != f"{prefix}200"
        )

    def count_running(self, status: int, version: str) -> None:
        """Count a request routed while the canary ran; a failure on another version than
        the canary is an error (the canary's are by design)."""
        self.running[f"v{version}:{status}"] += 1
        if status != 200 and version != str(self.canary):
            self.stable_failures += 1

    def checks(self) -> list[Check]:
        """The section's checks, each a figure against its bound."""
        sessions = len(self.session_versions)
        kept = sum(len(versions) == 1 for versions in self.session_versions.values())
        served = f"v{self.stable}:200"
        return [
            at_most(
                "the router answered from the new canary record",
                self.followed_after_s,
                FOLLOW_LIMIT_S,
                "s",
            ),
            at_most(
                "the canary was rolled back automatically",
                self.requests_to_rollback,
                MAX_REQUESTS,
                "requests",
            ),
            equal(
                "every session kept one version while the canary ran",
                kept,
                SESSIONS,
                f"of {sessions} sessions",
            ),
            equal(
                "no request failed on a version other than the canary",
                self.stable_failures,
                0,
                "failed",
            ),
            equal(
                f"after the rollback every request was answered 200 by v{self.stable}",
                self.after_rollback[served],
                AFTER_ROLLBACK,
                f"of {sum(self.after_rollback.values())} requests",
            ),
            equal(
                f"a request pinning the rolled-back v{self.canary} was refused",
                self.pinned_after_rollback,
                409,
                "(HTTP status)",
            ),
        ]

    @property
    def ok(self) -> bool:
        """Every check passed."""
        return all(check.passed for check in self.checks())


def _post(
    port: int, body: bytes, headers: dict[str, str], path: str = f"/v2/models/{MODEL}/infer"
) -> tuple[int, str]:
    """One infer request through the router: its status and the version that answered
    (599 and ``?`` when no answer came back, which the checks count as a failure)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        return response.status, response.getheader("x-spillway-model-version") or "?"
    except (OSError, http.client.HTTPException):
        return 599, "?"
    finally:
        conn.close()


def _session(step: int) -> str | None:
    """Every other request belongs to one of ``SESSIONS`` sessions, in turn."""
    return f"demo-user-{(step // 2) % SESSIONS}" if step % 2 else None


def _body(image: np.ndarray) -> bytes:
    tensor = {"name": "image", "shape": [1, 8, 8], "datatype": "FP32"}
    return json.dumps({"inputs": [{**tensor, "data": image.ravel().tolist()}]}).encode()


def follow_ttl_s() -> float:
    """How long a router may keep serving from a canary record it read before a change:
    its ``canary_ttl_s`` (``ROUTER_CANARY_TTL_S``, which the stack's router inherits)."""
    from spillway.router.settings import ENV_PREFIX, RouterSettings

    default = RouterSettings.model_fields["canary_ttl_s"].default
    return float(os.environ.get(f"{ENV_PREFIX}CANARY_TTL_S", default))


def wait_for_every_router(
    changed_at: float,
    ttl_s: float,
    *,
    margin_s: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Return once every router instance has read the canary record again after a change
    made at ``changed_at`` (on ``clock``): a router keeps a record at most ``ttl_s``, so
    no instance serves from the old one after that (the margin covers the write's own
    time). A deadline the router's contract sets, not a guess at how fast it is."""
    remaining = changed_at + ttl_s + margin_s - clock()
    if remaining > 0:
        sleep(remaining)


def _wait_until_followed(
    port: int, headers: dict[str, str], images: np.ndarray, report: CanaryReport
) -> None:
    """Send requests without a session until one is answered by the canary."""
    started = time.monotonic()
    step = 0
    while time.monotonic() - started < FOLLOW_LIMIT_S:
        status, version = _post(port, _body(images[step % len(images)]), headers)
        report.count_running(status, version)
        if version == str(report.canary):
            report.followed_after_s = time.monotonic() - started
            return
        step += 1


def _rolled_back(store: CanaryStore) -> bool:
    state = store.load(MODEL)
    return state is not None and state.status == "rolled_back"


def _load(stack: LocalStack) -> None:
    """Ask the GPU service to load the new version beside the serving one."""
    conn = http.client.HTTPConnection("127.0.0.1", stack.ports.gpu, timeout=120)
    conn.request("POST", f"/v2/repository/models/{MODEL}/load")
    response = conn.getresponse()
    response.read()
    if response.status != 200:
        raise RuntimeError(f"loading {MODEL} answered {response.status}")


Send = Callable[[int, str | None], tuple[int, str]]
"""Sends the section's request number ``step`` (in ``session``, or none): its status and
the version that answered."""


def until_rollback(send: Send, rolled_back: Callable[[], bool], report: CanaryReport) -> None:
    """Send requests, every other one in a session, until the canary is rolled back.

    Only a request the canary answered can roll it back (the guard judges as it counts
    one), and the router writes the rollback before it answers that request: the first
    canary answer after which the record reads ``rolled_back`` is the last request routed
    while the canary ran. The split is exact, whatever the timing; a canary session moved
    to the stable version by the rollback is never counted as a session that switched.
    """
    started = time.monotonic()
    for step in range(MAX_REQUESTS):
        session = _session(step)
        status, version = send(step, session)
        report.count_running(status, version)
        if session is not None:
            report.session_versions.setdefault(session, set()).add(version)
        if version == str(report.canary) and rolled_back():
            report.requests_to_rollback = step + 1
            report.rolled_back_after_s = time.monotonic() - started
            return


def after_rollback(send: Send, report: CanaryReport) -> None:
    """``AFTER_ROLLBACK`` requests, every other one in a session (the canary's included)."""
    for step in range(AFTER_ROLLBACK):
        status, version = send(step, _session(step))
        report.after_rollback[f"v{version}:{status}"] += 1


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
    started_at = time.monotonic()
    say(
        f"   {MODEL} v{canary} (fails 20 % of inputs) published beside v{stable} and "
        f"started at 10 %\n   (spillway models canary --model {MODEL} --version {canary} "
        f"--percent 10; config.json spillway.canary says the same)\n"
        "   This section fails requests on purpose: its failures on the canary are counted "
        "here, apart from the demo's errors."
    )
    report = CanaryReport(stable, canary)
    headers = {"Content-Type": "application/json", **stack.router_headers}
    port = stack.ports.router
    ttl_s = follow_ttl_s()
    # A router reads the record again within its canary_ttl_s: the first request of a
    # session that reached an instance still serving from the old record would be answered
    # unbound (by the backends' default version) and bound on a later one. Sessions begin
    # once one router answered from the canary and every router instance read it since.
    _wait_until_followed(port, headers, images, report)
    if report.followed_after_s is None:
        _tell(report, say)
        return report
    wait_for_every_router(started_at, ttl_s)
    say(
        f"   the router followed the new record after {report.followed_after_s:.1f} s; "
        f"sessions begin once every router instance has ({ttl_s:g} s, its canary_ttl_s)"
    )

    def send(step: int, session: str | None) -> tuple[int, str]:
        sent = {**headers, **({"x-spillway-session": session} if session else {})}
        return _post(port, _body(images[step % len(images)]), sent)

    until_rollback(send, lambda: _rolled_back(store), report)
    if report.requests_to_rollback is not None:
        wait_for_every_router(time.monotonic(), ttl_s)
    after_rollback(send, report)
    pinned = f"/v2/models/{MODEL}/versions/{canary}/infer"
    report.pinned_after_rollback = _post(port, _body(images[0]), headers, pinned)[0]
    report.state = store.load(MODEL)
    _tell(report, say)
    return report


def _tell(report: CanaryReport, say: Callable[[str], None]) -> None:
    total = sum(report.requests.values())
    on_canary = sum(n for k, n in report.requests.items() if k.startswith(f"v{report.canary}:"))
    failed = sum(n for k, n in report.requests.items() if not k.endswith(":200"))
    sticky = sum(len(v) == 1 for v in report.session_versions.values())
    canary_sessions = sum(v == {str(report.canary)} for v in report.session_versions.values())
    say(
        f"   {total} requests: {on_canary} ({on_canary / max(total, 1):.1%}) on the canary, "
        f"{failed} failed ({report.by_design_failures} on the canary, by design); while it "
        f"ran, {sticky}/{len(report.session_versions)} sessions kept one version "
        f"({canary_sessions} on the canary) and {report.stable_failures} requests failed "
        "on another version"
    )
    if report.followed_after_s is None:
        say(f"   the router did NOT answer from v{report.canary} within {FOLLOW_LIMIT_S:.0f} s")
        return
    if report.rolled_back_after_s is None:
        say(f"   the canary was NOT rolled back within {MAX_REQUESTS} requests")
    else:
        say(
            f"   rolled back automatically after {report.requests_to_rollback} requests "
            f"({report.rolled_back_after_s:.1f} s)"
        )
    after = ", ".join(f"{k} x{n}" for k, n in sorted(report.after_rollback.items()))
    say(f"   then {AFTER_ROLLBACK} requests (canary sessions included): {after}")
    say(
        f"   a request pinning v{report.canary} (/versions/{report.canary}/infer): "
        f"{report.pinned_after_rollback} (409 version_rolled_back unless the operator runs "
        "spillway models canary --allow-pinned)"
    )
    say("   spillway models status digits:\n" + _indent(describe(report.state, MODEL)))


def _indent(text: str) -> str:
    return "\n".join(f"     {line}" for line in text.splitlines())
