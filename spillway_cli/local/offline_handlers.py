"""The handlers serverless.yml's ``local`` stage names (``routerHandler``,
``websocketHandler``): the production handlers, each handed serverless-offline's Lambda
context adapted to read as Lambda's, so the functions themselves know nothing of
serverless-offline.

serverless-offline's Python runner (13.x, ``FakeLambdaContext`` in its ``invoke.py``)
hands every invocation a context with 6 s left whatever the function's timeout (its
context carries none), while it stops the invocation only at the function's own
timeout. ``OfflineContext`` counts that context's 6 s as the 29 s both template forms
give the functions behind API Gateway (``API_GATEWAY_TIMEOUT_S``), so that a request's
deadline locally is what it would be on AWS; a context that carries another timeout is
read as it is.

The runner takes the handler by name once, before the first event
(``getattr(module, name)``): the production handler is imported then, as Lambda's init
would import it, and only the one named.
"""

from __future__ import annotations

from typing import Any

from spillway.powertools import API_GATEWAY_TIMEOUT_S
from spillway_cli.local.lambda_runtime import Handler, load_handler

HANDLERS = {
    "router": "functions.router.handler.handler",
    "websocket": "functions.websocket.handler.handler",
}
"""Each handler here by its name, and the production handler it runs (serverless.yml's
``params.default``)."""
OFFLINE_CONTEXT_S = 6
"""What serverless-offline's Python runner gives every invocation, whatever the
function's timeout."""


class OfflineContext:
    """serverless-offline's context, its remaining time counted from ``timeout_s`` where
    the runner counted from its own 6 s; every other attribute is the context's."""

    def __init__(self, context: Any, timeout_s: int = API_GATEWAY_TIMEOUT_S) -> None:
        self._context = context
        self._extra_ms = 0
        if getattr(context, "timeout", None) == OFFLINE_CONTEXT_S:
            self._extra_ms = (timeout_s - OFFLINE_CONTEXT_S) * 1000

    def get_remaining_time_in_millis(self) -> int:
        return int(self._context.get_remaining_time_in_millis()) + self._extra_ms

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def under_serverless_offline(handler: Handler) -> Handler:
    """``handler``, handed ``OfflineContext`` in place of serverless-offline's context."""

    def offline(event: dict[str, Any], context: Any) -> Any:
        return handler(event, OfflineContext(context))

    return offline


def __getattr__(name: str) -> Handler:
    """``router`` or ``websocket``: the production handler, imported now, adapted."""
    if name not in HANDLERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return under_serverless_offline(load_handler(HANDLERS[name]))
