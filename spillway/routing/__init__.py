"""The routing domain, apart from any transport or AWS client.

``policy`` (ordered rules, validated), ``facts`` (what a request says about itself),
``decision`` (which rule fires and the chain of backends), ``health`` (circuit breakers,
load, the retry budget), ``accounting`` (what a route cost, one metrics line),
``policy_store`` (where the policy comes from, keeping the last good one) and ``backend``
(the contract every backend keeps, which the canary guard judges by). The router, the
tuner, the planner, the cost report and the dashboard all read these.
"""
