"""Canary versions: the record of a model's stable and canary version (``records``), the
version-choice stage the router's route goes through (``stage``: pick a request's arm,
walk the chain with it, walk again on the stable version, settle the outcome; with a
stand-in for a router without canaries), the choice and the backends' version contract
behind it (``selection``), and the guard that rolls a bad canary back (``guard``)."""
