"""Errors of the jobs API, in the core's hierarchy (status and stable code)."""

from __future__ import annotations

from spillway.errors import SpillwayError


class JobNotFoundError(SpillwayError):
    """No job with this id."""

    status = 404
    code = "job_not_found"


class JobConflictError(SpillwayError):
    """The request clashes with an existing job (its key, its output prefix)."""

    status = 409
    code = "job_conflict"


class ShardFailedError(SpillwayError):
    """A shard could not be completed; the child exits non-zero so Batch retries it."""

    status = 500
    code = "shard_failed"


class NotConfiguredError(SpillwayError):
    """A setting the operation needs is missing (e.g. the schedule's model)."""

    status = 500
    code = "not_configured"
