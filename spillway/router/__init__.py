"""The router service: policy routing over the GPU service, the CPU fallback and batch.

A request reads top to bottom: ``app`` (WSGI application) → ``dispatch.Router.route``:
read the request with ``spillway.policy.facts`` under the policy in force; pick its arm,
the version it is sent to, from the version-choice stage (``spillway.canary.stage``: the
canary's, or its stand-in where there are no canaries); decide with
``spillway.policy.decision``; walk the fallback chain with the arm over ``backends`` and
``lambda_backend`` behind ``spillway.policy.health``'s circuit breakers (walking again on
the stable version when the arm says so); account with ``spillway.policy.accounting``;
the arm settles the answer → a reply. ``deadlines`` says how long a request may take
(its own latency budget, its model's, or the default) and what its 504 says.
``async_mode``, ``batch_mode`` and ``sessions`` are the other modes; ``openai_compat``
is the OpenAI-compatible door (embeddings as the V2 infer request of their texts, through
the same ``Router.route``); ``wiring`` builds it all from ``settings``. The Lambda
(``functions.router.handler``) and ``spillway serve router`` are two transports over the
same application.
"""
