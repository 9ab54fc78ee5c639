"""What one routed request came to, for whoever watches the router (data capture).

``Router.route`` hands every request it read a ``Routed`` once its reply is settled, or
once it refused the request with a ``SpillwayError`` (``reply`` is then that error's
answer). The watcher runs on the request's thread after the reply is built: it must only
hand the record on (a bounded queue), never wait on I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from spillway.policy.facts import Call, Request
from spillway.protocol.replies import Reply
from spillway.protocol.wire import Target


@dataclass(frozen=True)
class Routed:
    """One request as it ended at the router."""

    call: Call
    """The client's call as received (method, headers, body, request id)."""
    target: Target
    """What it asked for (operation, model, the version it named)."""
    tenant: str | None
    """The tenant the router served it as (``None``: no tenant)."""
    reply: Reply
    """What the client is sent: the backend's answer or the error, with the router's
    ``x-spillway-*`` headers."""
    backend: str | None
    """The backend whose answer it is (``None``: no backend answered)."""
    version: str | None
    """The model version the answer came from, when the request or the canary chose one."""
    latency_s: float
    """Router time from receipt to reply."""
    trace_id: str | None
    """The request's W3C trace id (32 hex digits), when it carries or started a trace."""
    request: Request | None = None
    """The request as the router read it (``None``: too malformed to read)."""


Watcher = Callable[[Routed], None]
"""Called once per routed request; must not block."""
