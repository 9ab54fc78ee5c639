"""The WebSocket Lambda's entry point: ``functions.websocket.handler.handler``.

Built at init: the router from ``ROUTER_*`` (policy, fallback, canary, cost and tenancy are
the REST API's), the connection store on its state table (``ROUTER_STATE_TABLE``; unset:
``$connect`` is refused with 503 ``websocket_not_configured``), the poster of answers
(``@connections``), each tenant's budget of connections, frames in flight and frame rate
(on the same table) and ``WS_*``. An adapter in Powertools' shape: Logger (correlation id:
API Gateway's request id), Metrics (cold start; at a connection's end its frames, bytes
and cost) and, with ``WS_TRACING`` on, Tracer around one ``StreamGateway.handle``.
"""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.logging import Logger
from aws_lambda_powertools.metrics import Metrics, MetricUnit

from spillway.powertools import API_GATEWAY_REQUEST_ID, NAMESPACE, remaining_ms, traced
from spillway.router.settings import RouterSettings
from spillway.router.wiring import Overrides, create_app, state_store
from spillway.state.table import DynamoStateStore
from spillway.streams.connections import Connection
from spillway.streams.delivery import ApiGatewayPoster
from spillway.streams.dynamo_connections import DynamoConnections
from spillway.streams.gateway import StreamGateway
from spillway.streams.settings import StreamSettings
from spillway.streams.tenants import DynamoTenantBudgets
from spillway.tenancy.directory import apply_log_level
from spillway.tenancy.identity import Authenticator

SERVICE = "spillway-websocket"
# A connection's counters as metrics at its end: (counter, metric, unit).
CLOSING_METRICS = (
    ("frames_in", "WebSocketFramesIn", MetricUnit.Count),
    ("frames_answered", "WebSocketFramesAnswered", MetricUnit.Count),
    ("frames_failed", "WebSocketFramesFailed", MetricUnit.Count),
    ("frames_refused", "WebSocketFramesRefused", MetricUnit.Count),
    ("bytes_in", "WebSocketBytesIn", MetricUnit.Bytes),
    ("bytes_out", "WebSocketBytesOut", MetricUnit.Bytes),
    ("cost_usd", "WebSocketCostUsd", MetricUnit.NoUnit),
)

settings = StreamSettings.from_env()
router_settings = RouterSettings.from_env()
# The parent of the router's and the gateway's loggers (``spillway.router``,
# ``spillway.streams``): their lines get the context too.
logger = Logger(service="spillway", level=router_settings.log_level)
metrics = Metrics(namespace=NAMESPACE, service=SERVICE)
state = state_store(router_settings)
app = create_app(router_settings, Overrides(state=state))
router = app.router
# The live configuration (``spillway tenants``): the identity map ``$connect`` resolves
# tenants with, read at init and every ROUTER_CONFIG_TTL_S, as the REST door's.
if app.live is not None:
    app.live.subscribe(lambda config: apply_log_level(config, logger))
    app.live.poll()


def closed(connection: Connection) -> None:
    """Put a closed connection's counters as metrics (flushed with this invocation's)."""
    for counter, name, unit in CLOSING_METRICS:
        metrics.add_metric(name=name, unit=unit, value=connection.counters.get(counter, 0.0))


table = state if isinstance(state, DynamoStateStore) else None
gateway = StreamGateway(
    router,
    DynamoConnections(table) if table is not None else None,
    ApiGatewayPoster(),
    settings,
    Authenticator(
        identity_tenants=app.identity_tenants,
        trust_tenant_hints=router_settings.trust_tenant_hints,
    ),
    on_close=closed,
    budgets=DynamoTenantBudgets(table) if table is not None else None,
)


@traced(settings.tracing, SERVICE)
@metrics.log_metrics(capture_cold_start_metric=True)
@logger.inject_lambda_context(correlation_id_path=API_GATEWAY_REQUEST_ID)
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """Serve one API Gateway WebSocket event (``$connect``, ``$disconnect``, ``$default``)."""
    if app.live is not None:
        app.live.poll()
    return gateway.handle(event, remaining_ms(context))
