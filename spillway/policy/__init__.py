"""The routing policy and its judgement, apart from any transport or AWS client.

``rules`` (the policy's ordered rules, validated), ``facts`` (what a request says about itself),
``decision`` (which rule fires and the chain of backends), ``health`` (circuit breakers,
load, the retry budget), ``accounting`` (what a route cost, one metrics line),
``store`` (where the policy comes from, keeping the last good one) and ``backend``
(the contract every backend keeps, which the canary guard judges by). The router, the
tuner, the planner, the cost report and the dashboard all read these.
"""
