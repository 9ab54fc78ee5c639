"""The router Lambda: policy routing over the GPU service, the CPU fallback and batch.

A request reads top to bottom: ``app`` (WSGI transport) → ``routing.Router.route`` (read
the request with ``facts``, decide with ``policy``/``decide``/``policy_store``, walk the
fallback chain over ``backends`` behind ``health``'s circuit breakers, account with
``accounting``) → a reply. ``handler`` adapts API Gateway events with serverless-wsgi;
``serve`` runs the same application on 127.0.0.1; ``wiring`` builds it from settings.
"""
