"""The router Lambda: policy routing over the GPU service, the CPU fallback and batch.

A plain WSGI application (``app``) over a transport-free core (``router``): the policy picks
a chain of backends, the router walks it within the request's deadline, behind a circuit
breaker per backend, and accounts the cost of what served. ``handler`` adapts API Gateway
events with serverless-wsgi; ``serve`` runs the same application on 127.0.0.1.
"""
