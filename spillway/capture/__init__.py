"""Data capture: a sample of the router's inference requests and answers, per tenant, in S3.

The policy's ``capture`` section (``spillway.policy.rules.CaptureRule``) says which
requests are kept, at what rate and with which bodies; ``ROUTER_CAPTURE_ROOT`` says where.
The router's watcher (``watcher.Capture``) turns a routed request into one record and only
hands it to a bounded in-memory buffer (``buffer``); a background thread (``writer``)
writes each tenant's records for one model and hour as one gzip JSON Lines object in that
tenant's area (``layout``). ``reader`` reads one tenant's records back and ``replay``
sends them again and compares the answers (``spillway capture``). docs/capture.md has the
record's schema, the costs and what can be lost.
"""
