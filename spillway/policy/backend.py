"""The backend contract: what the router sends a backend, what it gets back, how an
attempt fails, and the ``Backend`` protocol every backend implements.

A backend takes a ``BackendRequest`` and a timeout and returns the backend's status,
headers and body, or raises a ``BackendError`` saying how it failed: it could not be
reached (``ConnectFailed``), it did not answer in time (``TimedOut``), the connection
broke (``ConnectionLost``), or it cannot take this request at all (``CannotServe``, e.g.
a body over the Lambda payload limit). The router decides what each means; the canary
guard judges a version by the answers. The backends themselves (HTTP, Lambda, batch) are
the router's: ``spillway.router.backends``, ``spillway.router.lambda_backend``,
``spillway.router.batch_mode``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from spillway.protocol.errors import SpillwayError
from spillway.protocol.wire import Target


@dataclass(frozen=True)
class BackendRequest:
    """What one attempt sends: method, path, the allowed headers and the body."""

    method: str
    path: str
    operation: str
    model: str | None = None
    version: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""
    request_id: str = ""
    tenant: str | None = None


@dataclass(frozen=True)
class BackendResponse:
    """What a backend answered; ``billed_s`` is the compute time it charges for."""

    status: int
    headers: dict[str, str]
    body: bytes
    elapsed_s: float
    billed_s: float | None = None


class BackendError(Exception):
    """An attempt that produced no response; ``kind`` names how it failed."""

    kind = "error"


class ConnectFailed(BackendError):
    """The backend could not be reached (refused, unresolvable, connect timeout)."""

    kind = "connect_error"


class TimedOut(BackendError):
    """The backend did not answer within the attempt's timeout."""

    kind = "timeout"


class ConnectionLost(BackendError):
    """The connection broke before a whole response arrived."""

    kind = "connection_lost"


class CannotServe(BackendError):
    """This backend cannot take this request (not a fault of the backend)."""

    kind = "cannot_serve"


class Backend(Protocol):
    """Something that serves Open Inference Protocol requests."""

    name: str

    def send(self, request: BackendRequest, timeout_s: float) -> BackendResponse:
        """One attempt within ``timeout_s``; raises ``BackendError`` without a response."""
        ...


class Unanswered(Exception):
    """No backend said what a model's configuration is (unreachable, busy, loading)."""


def served_config(backends: Mapping[str, Backend], model: str, timeout_s: float) -> bytes | None:
    """``model``'s ``config.json`` as a backend serves it: the GPU service's, else the
    CPU fallback's, each asked within ``timeout_s``; ``None`` when one says it does not
    know the name (404). Raises ``Unanswered`` when neither says either."""
    request = BackendRequest("GET", Target("config", model).path, "config", model=model)
    for name in ("gpu", "cpu"):
        backend = backends.get(name)
        if backend is None:
            continue
        try:
            response = backend.send(request, timeout_s)
        except (BackendError, SpillwayError):  # unreachable, or cannot ask it this
            continue
        if response.status == 200:
            return response.body
        if response.status == 404:
            return None
    raise Unanswered(model)
