"""Canary versions: the record of a model's stable and canary version (``records``), the
version a request gets (``selection``) and the guard that rolls a bad canary back
(``guard``)."""
