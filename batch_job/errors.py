"""Errors of the jobs API, in the core's hierarchy (status and stable code)."""

from __future__ import annotations

from spillway.protocol.errors import SpillwayError

EXIT_NO_RETRY = 3
"""Exit code of ``spillway jobs run`` for errors a retry cannot fix (a missing model, a
batch size past the limit); the Batch retry strategy stops on it."""


class JobNotFoundError(SpillwayError):
    """No job with this id."""

    status = 404
    code = "job_not_found"


class JobConflictError(SpillwayError):
    """The request clashes with an existing job (its key, its output prefix)."""

    status = 409
    code = "job_conflict"


class NotConfiguredError(SpillwayError):
    """A setting the operation needs is missing (e.g. the schedule's model)."""

    status = 500
    code = "not_configured"


class InputChangedError(SpillwayError):
    """A shard's input object is not the one the plan recorded (its ETag differs): running
    it would mix two versions of the input in one job's outputs."""

    status = 412
    code = "input_changed"
