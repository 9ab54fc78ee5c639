"""``make demo``: the whole platform on 127.0.0.1, with real traffic through the router
(``run.run_demo``).

Scenarios, in order (``sections``: the one list of them, which numbers them): digits
on the GPU tier (accuracy), minilm similarity, a request the policy sends to the CPU
fallback (``serving``), an offline batch job over S3 (``batch``), the GPU service killed
under load (nothing fails: the router falls back) and a hot swap under load (nothing
fails; ``faults``), then a canary that fails on purpose (``canary``), async requests
(``async_requests``) and a pipeline (``pipelines``), 50 concurrent frame streams through
the WebSocket API and gRPC streams (``streams``), a summary per backend and a chart of
latency and routing over time (``report``). The requests of the sections
marked ``recorded`` (all but the batch job's of the first six) go through one recording
client (``client``).

Each section ends with its checks (``spillway_cli.console.Check``: a figure against its
bound). A failed check is printed at once with its name, figure and bound; the run ends
by listing the failed ones and exits 1. The canary section fails requests by design:
those failures are reported in that section and counted in no error total. No check
depends on how fast a loaded machine is: deadlines are generous, and the checks count
requests and compare versions and statuses.

The terminal gets the report only: every log line (the stack's, boto's, the batch job's)
goes to ``<out>/demo.log`` and each service's own log file; ``--verbose`` also shows the
log lines in the terminal.
"""
