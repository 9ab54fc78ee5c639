"""How the batch job's errors end a run: the exit code a retry cannot fix.

The jobs API's and the records' error classes are the core's (``spillway.protocol.errors``:
``job_not_found``, ``job_conflict``, ``job_not_configured``, ``input_changed``,
``duplicate_id``).
"""

from __future__ import annotations

EXIT_NO_RETRY = 3
"""Exit code of ``spillway jobs run`` for errors a retry cannot fix (a missing model, a
batch size past the limit); the Batch retry strategy stops on it."""
