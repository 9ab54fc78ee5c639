"""What the capture unit tests share: a routed request as the router hands it over, an
in-memory S3 for the writer, and a clock that moves when told to."""

from __future__ import annotations

import gzip
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from spillway.capture.records import CaptureRecord, parse_record
from spillway.policy.facts import Call, Request, read_request
from spillway.protocol.errors import SpillwayError
from spillway.protocol.replies import Reply
from spillway.protocol.wire import Target, require_model_target
from spillway.router.routed import Routed

IMAGE = [float(i % 17) for i in range(64)]
BODY = json.dumps(
    {"inputs": [{"name": "image", "shape": [1, 8, 8], "datatype": "FP32", "data": IMAGE}]}
).encode()
RESULT = json.dumps(
    {
        "model_name": "digits",
        "model_version": "1",
        "outputs": [
            {"name": "label", "shape": [1, 1], "datatype": "INT64", "data": [3]},
            {"name": "probabilities", "shape": [1, 2], "datatype": "FP32", "data": [0.25, 0.75]},
        ],
    }
).encode()


class Clock:
    """A monotonic clock that only moves when told to."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def routed(
    *,
    body: bytes = BODY,
    reply: Reply | None = None,
    tenant: str | None = "acme",
    path: str = "/v2/models/digits/infer",
    headers: dict[str, str] | None = None,
    backend: str | None = "gpu",
    latency_s: float = 0.0123,
) -> Routed:
    """A routed infer request as ``Router.route`` hands it to its watcher."""
    target = require_model_target(path)
    call = Call("POST", {"content-type": "application/json", **(headers or {})}, body, "req-1")
    answer = reply or Reply(
        200,
        [
            ("content-type", "application/json"),
            ("x-spillway-model-version", "1"),
            ("x-spillway-rule", "default"),
            ("x-spillway-backend", "gpu"),
        ],
        RESULT,
    )
    try:
        request: Request | None = read_request(call, target)
    except SpillwayError:  # too malformed to read: the router hands over none
        request = None
    return Routed(
        call=call,
        target=target,
        tenant=tenant,
        reply=answer,
        backend=backend,
        version=target.version,
        latency_s=latency_s,
        trace_id="0af7651916cd43dd8448eb211c80319c",
        request=request,
    )


def metadata_routed() -> Routed:
    """A metadata request (never captured)."""
    target = Target("metadata", "digits")
    call = Call("GET", {}, b"", "req-2")
    return Routed(call, target, "acme", Reply(200, [], b"{}"), "gpu", None, 0.001, None, None)


@dataclass
class MemoryS3:
    """``put_object`` and ``get_object`` of a boto3 client, in memory; ``gate`` (when set)
    holds every put until it is opened, and ``fail`` makes the next puts raise."""

    objects: dict[tuple[str, str], bytes] = field(default_factory=dict)
    gate: threading.Event | None = None
    fail: int = 0
    puts: int = 0

    def put_object(self, *, Bucket: str, Key: str, Body: bytes, **_: Any) -> dict[str, Any]:
        self.puts += 1
        if self.gate is not None:
            self.gate.wait(30)
        if self.fail:
            self.fail -= 1
            raise OSError("S3 is down")
        self.objects[(Bucket, Key)] = Body
        return {}

    def records(self, prefix: str = "") -> list[CaptureRecord]:
        """Every record in the objects whose key starts with ``prefix``."""
        found = []
        for (_, key), body in sorted(self.objects.items()):
            if key.startswith(prefix):
                for line in gzip.decompress(body).splitlines():
                    record = parse_record(line)
                    assert record is not None
                    found.append(record)
        return found
