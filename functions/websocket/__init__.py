"""The WebSocket Lambda: ``handler`` adapts API Gateway WebSocket events to
``spillway.streams.gateway.StreamGateway``, routing frames with ``spillway.router``."""
