"""The router Lambda: ``handler`` adapts API Gateway events to the router application of
``spillway.router``."""
