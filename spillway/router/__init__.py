"""The router service: policy routing over the GPU service, the CPU fallback and batch.

A request reads top to bottom: ``app`` (WSGI application) → ``dispatch.Router.route`` (read
the request with ``spillway.policy.facts``, decide with ``spillway.policy.decision``,
walk the fallback chain over ``backends`` and ``lambda_backend`` behind
``spillway.policy.health``'s circuit breakers, account with ``spillway.policy.accounting``)
→ a reply. ``async_mode``, ``batch_mode`` and ``sessions`` are the other modes;
``wiring`` builds it all from ``settings``. The Lambda (``functions.router.handler``) and
``spillway serve router`` are two transports over the same application.
"""
