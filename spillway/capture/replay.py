"""Replaying captured requests and comparing the answers: a canary's evidence.

Each replayable record's request is sent again, byte for byte (a binary body with its
``Inference-Header-Content-Length``), to ``/v2/models/<model>[/versions/<v>]/infer`` of
another router or GPU service, and the new answer is compared with the captured one:

* a captured 200: same output names, datatypes and shapes, and the values within
  ``rtol``/``atol`` for floating-point tensors (exactly for the others);
* a captured 4xx: the same status and error code (the request is still refused alike).

A record whose request was not kept whole (``truncated``, ``keep: outputs``), whose
answer was not kept (``keep: inputs``), or whose captured answer is no result (a 5xx, a
202 of async or batch mode) is *not replayable*: it is counted, not sent. A request
that gets no answer at all (refused connection, timeout) is *failed*.

Sending is injected (``Send``), so the comparison is tested without a server; numpy is
imported by the comparison only (never by the router).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from spillway.capture.records import CapturedBody, CaptureRecord
from spillway.protocol.framing import BINARY_CONTENT_TYPE, HEADER_LENGTH, JSON_CONTENT_TYPE
from spillway.protocol.names import validate_version

Verdict = Literal["matched", "differed", "not_replayable", "failed"]
VERDICTS: tuple[Verdict, ...] = ("matched", "differed", "not_replayable", "failed")
FLOAT_TYPES = frozenset({"FP16", "FP32", "FP64", "BF16"})


@dataclass(frozen=True)
class Answer:
    """What a replayed request got: status, headers (names lower-case) and body."""

    status: int
    headers: Mapping[str, str]
    body: bytes


class SendFailed(Exception):
    """The request got no answer (refused connection, timeout, broken connection)."""


Send = Callable[[str, Mapping[str, str], bytes], Answer]
"""POSTs a body to a path with headers; ``SendFailed`` when nothing answers."""


@dataclass(frozen=True)
class Tolerance:
    """How close floating-point outputs must be: ``|new - old| <= atol + rtol * |old|``."""

    rtol: float = 1e-5
    atol: float = 1e-6


@dataclass(frozen=True)
class Replayed:
    """One record's replay: its verdict and why."""

    record: CaptureRecord
    verdict: Verdict
    reason: str = ""
    status: int | None = None
    """The replayed answer's status (``None``: not sent, or no answer)."""


@dataclass
class Report:
    """The verdicts of a replay."""

    results: list[Replayed] = field(default_factory=list)

    @property
    def counts(self) -> dict[Verdict, int]:
        """How many records got each verdict."""
        counted = Counter(result.verdict for result in self.results)
        return {verdict: counted.get(verdict, 0) for verdict in VERDICTS}

    @property
    def compared(self) -> int:
        """Records whose answers were compared."""
        counts = self.counts
        return counts["matched"] + counts["differed"]

    def summary(self) -> str:
        """One line: the counts."""
        c = self.counts
        return (
            f"replayed {len(self.results)} records: {c['matched']} matched, "
            f"{c['differed']} differed, {c['not_replayable']} not replayable, "
            f"{c['failed']} failed"
        )


def infer_path(model: str, version: str | None) -> str:
    """The Open Inference Protocol infer path of ``model`` (and ``version``)."""
    if version is None:
        return f"/v2/models/{model}/infer"
    return f"/v2/models/{model}/versions/{validate_version(version)}/infer"


def not_replayable(record: CaptureRecord) -> str | None:
    """Why ``record`` cannot be replayed and compared (``None``: it can)."""
    if record.truncated:
        return "truncated: a body passed the record's cap"
    if record.request is None or not record.replayable or record.request.raw() is None:
        return "the request was not kept (keep: outputs)"
    if record.response is None:
        return "no captured answer to compare (keep: inputs)"
    if record.status >= 500:
        return f"the capture holds a server failure ({record.status}): no answer to compare"
    if record.status != 200 and record.status < 400:
        return f"the capture holds a {record.status}, not a result"
    return None


def replay(
    records: Iterable[CaptureRecord],
    send: Send,
    *,
    version: str | None = None,
    tolerance: Tolerance = Tolerance(),
) -> Report:
    """Replay ``records`` through ``send`` (to ``version`` when given, else the version
    each request named) and judge each answer."""
    report = Report()
    for record in records:
        report.results.append(replay_one(record, send, version=version, tolerance=tolerance))
    return report


def replay_one(
    record: CaptureRecord, send: Send, *, version: str | None, tolerance: Tolerance
) -> Replayed:
    """Replay one record and judge its answer."""
    why = not_replayable(record)
    request = record.request
    if why is not None or request is None:
        return Replayed(record, "not_replayable", why or "")
    body = request.raw() or b""
    headers = {"content-type": request.content_type or JSON_CONTENT_TYPE}
    if request.header_length is not None:
        headers[HEADER_LENGTH] = str(request.header_length)
        headers["content-type"] = request.content_type or BINARY_CONTENT_TYPE
    path = infer_path(record.model, version if version is not None else record.requested_version)
    try:
        answer = send(path, headers, body)
    except SendFailed as exc:
        return Replayed(record, "failed", str(exc)[:300])
    difference = compare(record, answer, tolerance)
    if difference is None:
        return Replayed(record, "matched", status=answer.status)
    return Replayed(record, "differed", difference, status=answer.status)


def compare(record: CaptureRecord, answer: Answer, tolerance: Tolerance) -> str | None:
    """How ``answer`` differs from the captured one (``None``: it does not)."""
    if answer.status != record.status:
        return f"status {answer.status}, captured {record.status}"
    if record.status >= 400:
        code = _error_code(answer.body)
        captured = record.error.code if record.error is not None else None
        if code is not None and captured is not None and code != captured:
            return f"error code {code}, captured {captured}"
        return None
    if record.response is None:  # not_replayable rules it out before sending
        return "no captured answer to compare"
    return compare_outputs(record.response, answer, tolerance)


def _error_code(body: bytes) -> str | None:
    try:
        document = json.loads(body)
    except ValueError:
        return None
    code = document.get("code") if isinstance(document, dict) else None
    return code if isinstance(code, str) else None


def compare_outputs(captured: CapturedBody, answer: Answer, tolerance: Tolerance) -> str | None:
    """How the outputs of ``answer`` differ from the captured answer's (``None``: they
    agree within ``tolerance``)."""
    from spillway.protocol.codec import decode_response  # numpy: the CLI's side only
    from spillway.protocol.errors import SpillwayError

    old_raw = captured.raw()
    if old_raw is None:
        return "the captured answer cannot be read"
    try:
        old_header, old = decode_response(old_raw, captured.header_length)
    except SpillwayError as exc:
        return f"the captured answer is not an inference response: {exc.message[:200]}"
    try:
        length = answer.headers.get(HEADER_LENGTH)
        new_header, new = decode_response(answer.body, int(length) if length else None)
    except (SpillwayError, ValueError) as exc:
        return f"the answer is not an inference response: {str(exc)[:200]}"
    if set(old) != set(new):
        return f"outputs {sorted(new)}, captured {sorted(old)}"
    old_types = {t.name: t.datatype for t in old_header.outputs}
    new_types = {t.name: t.datatype for t in new_header.outputs}
    for name in sorted(old):
        if old_types[name] != new_types[name]:
            return f"output {name!r}: datatype {new_types[name]}, captured {old_types[name]}"
        difference = _tensor_difference(old[name], new[name], old_types[name], tolerance)
        if difference is not None:
            return f"output {name!r}: {difference}"
    return None


def _tensor_difference(old: Any, new: Any, datatype: str, tolerance: Tolerance) -> str | None:
    import numpy as np

    if tuple(old.shape) != tuple(new.shape):
        return f"shape {list(new.shape)}, captured {list(old.shape)}"
    if datatype not in FLOAT_TYPES:
        if np.array_equal(old, new):
            return None
        unequal = int(np.count_nonzero(old != new))
        return f"{unequal} of {old.size} values differ"
    a, b = np.asarray(old, dtype=np.float64), np.asarray(new, dtype=np.float64)
    close = np.isclose(b, a, rtol=tolerance.rtol, atol=tolerance.atol, equal_nan=True)
    if bool(close.all()):
        return None
    gaps = np.where(close, 0.0, np.nan_to_num(np.abs(b - a), nan=np.inf))
    worst = tuple(int(i) for i in np.unravel_index(int(np.argmax(gaps)), gaps.shape))
    return (
        f"{int((~close).sum())} of {close.size} values beyond rtol={tolerance.rtol:g} "
        f"atol={tolerance.atol:g} (largest gap {float(gaps[worst]):.6g} at {list(worst)})"
    )
