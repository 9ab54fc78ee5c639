"""API Gateway's throttles in front of a WebSocket API: the stage's token bucket over
every route, and the quota of new connections a second. A message past either gets API
Gateway's ``Too Many Requests`` frame and no invocation; an upgrade past either is
refused with 429."""

from __future__ import annotations

import time
from collections.abc import Callable

from spillway.aws.limits import WS_NEW_CONNECTIONS_PER_S

THROTTLE_RATE = 1000.0
THROTTLE_BURST = 2000
"""The stage's ``DefaultRouteSettings`` (template.yaml, serverless.yml): a token bucket of
``THROTTLE_BURST`` tokens refilled at ``THROTTLE_RATE`` a second, one token a message or
``$connect``; past it the client gets ``429 Too Many Requests``
(https://docs.aws.amazon.com/apigateway/latest/developerguide/websocket-api-protect.html)."""
NEW_CONNECTIONS_PER_S = float(WS_NEW_CONNECTIONS_PER_S)
"""API Gateway's quota of new WebSocket connections a second (per account and Region):
https://docs.aws.amazon.com/apigateway/latest/developerguide/apigateway-execution-service-websocket-limits-table.html
(it sets no quota on concurrent connections; ``max_connections`` is this stand-in's own)."""


class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` kept: API Gateway's throttle."""

    def __init__(
        self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("a token bucket needs a positive rate and a burst of at least 1")
        self.rate, self.burst, self.clock = rate, float(burst), clock
        self.tokens, self._at = float(burst), clock()

    def take(self) -> bool:
        """Whether a token was there (and is now taken)."""
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self._at) * self.rate)
        self._at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


def stage_throttle() -> TokenBucket:
    """The stage's throttle: every message and ``$connect`` takes a token."""
    return TokenBucket(THROTTLE_RATE, THROTTLE_BURST)


def new_connection_quota() -> TokenBucket:
    """API Gateway's quota of new connections: ``NEW_CONNECTIONS_PER_S`` a second."""
    return TokenBucket(NEW_CONNECTIONS_PER_S, int(NEW_CONNECTIONS_PER_S))
