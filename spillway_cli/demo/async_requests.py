"""The demo's async section: requests accepted at once (202), polled, answered once.

Twenty digits images go to the router with ``Prefer: respond-async``: nineteen in the
request body, the last one named as ``input_location`` in the caller's own area (which
every 202 receipt names), as a client with a large input would. Each is polled at
``/v1/results/{id}`` until its result is there, and every result is checked against the
synchronous answer for the same image.
"""

from __future__ import annotations

import http.client
import json
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from spillway.protocol.s3urls import parse_s3_url
from spillway_cli.console import Check, equal

REQUESTS = 20


@dataclass
class AsyncReport:
    """What the section saw."""

    accepted: int = 0
    finished: int = 0
    matching: int = 0
    states_seen: tuple[str, ...] = ()
    seconds: float = 0.0

    def checks(self) -> list[Check]:
        """Every request accepted, finished and equal to its synchronous answer."""
        of = f"of {REQUESTS} requests"
        return [
            equal("accepted at once (202)", self.accepted, REQUESTS, of),
            equal("finished before the deadline", self.finished, REQUESTS, of),
            equal("equal to the synchronous answer", self.matching, REQUESTS, of),
        ]

    @property
    def ok(self) -> bool:
        """Every check passed."""
        return all(check.passed for check in self.checks())


def _call(
    port: int, method: str, path: str, headers: Mapping[str, str], body: Any = None
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        data = None if body is None else json.dumps(body).encode()
        sent = {"content-type": "application/json", **headers}
        conn.request(method, path, body=data, headers=sent)
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def _named_input(port: int, headers: Mapping[str, str], area: str, body: Any) -> Any:
    """Put ``body`` in the caller's area and submit it by ``input_location``."""
    from spillway.aws.clients import aws_client
    from spillway_cli.local.names import REGION

    url = f"{area}demo/{uuid.uuid4().hex}.json"
    where = parse_s3_url(url)
    aws_client("s3", REGION).put_object(
        Bucket=where.bucket, Key=where.prefix, Body=json.dumps(body).encode()
    )
    named = {"inputs": [], "parameters": {"input_location": url}}
    return _call(
        port, "POST", "/v2/models/digits/infer", {**headers, "prefer": "respond-async"}, named
    )


def _label(raw: bytes) -> Any:
    return {o["name"]: o["data"] for o in json.loads(raw)["outputs"]}["label"]


def scenario_async(
    port: int,
    headers: Mapping[str, str],
    models: Path,
    say: Callable[[str], None],
    *,
    timeout_s: float = 120.0,
) -> AsyncReport:
    """Run the section against the router on ``port``; its report."""
    images = np.load(models / "digits/samples/images.npy", allow_pickle=False)[:REQUESTS]
    bodies = [
        {
            "inputs": [
                {
                    "name": "image",
                    "shape": [1, 8, 8],
                    "datatype": "FP32",
                    "data": image.astype(np.float32).ravel().tolist(),
                }
            ]
        }
        for image in images
    ]
    expected = []
    for body in bodies:
        status, _, raw = _call(port, "POST", "/v2/models/digits/infer", headers, body)
        expected.append(_label(raw) if status == 200 else None)
    report = AsyncReport()
    started = time.monotonic()
    ids = []
    area = ""
    for index, body in enumerate(bodies):
        if index == len(bodies) - 1 and area:
            status, got, raw = _named_input(port, headers, area, body)
        else:
            status, got, raw = _call(
                port, "POST", "/v2/models/digits/infer", {**headers, "prefer": "respond-async"},
                body,
            )  # fmt: skip
        if status == 202:
            receipt = json.loads(raw)
            area = area or receipt["areas"][0]
            report.accepted += 1
            ids.append((receipt["id"], got.get("location", "")))
    say(
        f"   {report.accepted}/{REQUESTS} requests accepted at once (202, "
        f"Location {ids[0][1] if ids else '-'}; the last named as input_location in the "
        f"caller's area {area or '-'})"
    )
    states: list[str] = []
    pending = dict(enumerate(ids))
    while pending and time.monotonic() - started < timeout_s:
        for index, (_, location) in list(pending.items()):
            status, _, raw = _call(port, "GET", location, headers)
            if status == 202:
                state = json.loads(raw)["state"]
                if state not in states:
                    states.append(state)
                continue
            del pending[index]
            report.finished += 1
            if status == 200 and _label(raw) == expected[index]:
                report.matching += 1
        time.sleep(0.1)
    report.seconds = time.monotonic() - started
    report.states_seen = tuple(states)
    say(
        f"   polled /v1/results/{{id}}: states seen {', '.join(states) or '-'}; "
        f"{report.finished} finished in {report.seconds:.1f} s, {report.matching} equal to "
        "the synchronous answer (the GPU service consumed the queue while it had room)"
    )
    return report
