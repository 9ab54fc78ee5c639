"""One error hierarchy for every transport.

Each class carries the HTTP status and a stable machine-readable ``code``. Transports map
``SpillwayError`` to a response once (``status``, ``{"error": message, "code": code}``);
they never match on message text.

Every error class a client can see is declared here, whichever door or deployable raises
it, and one code has one status (``tests/unit/test_error_codes.py`` reads the source and
checks both; ``docs/errors.md`` lists every code). First the errors of every door, then
those of one feature: the batch job, WebSocket frames, the shared state table and the
gRPC door. Exceptions that never reach a client as such (a refused frame that carries
its error, a connection that is gone) stay in their own modules.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

MAX_NAMES_LISTED = 20
"""The most valid names an error message lists before ``and N more``."""


def name_list(names: Iterable[str], limit: int = MAX_NAMES_LISTED) -> str:
    """Valid names for an error message: sorted, quoted, at most ``limit`` of them and
    then ``and N more``; ``none`` when there are none."""
    ordered = sorted(set(names))
    if not ordered:
        return "none"
    shown = ", ".join(repr(n) for n in ordered[:limit])
    rest = len(ordered) - limit
    return f"{shown} and {rest} more" if rest > 0 else shown


class SpillwayError(Exception):
    """Base class: an error a client may see, with its HTTP status and stable code."""

    status: ClassVar[int] = 500
    code: ClassVar[str] = "internal"

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s

    def to_body(self) -> dict[str, str]:
        """The Open Inference Protocol error body plus Spillway's stable code."""
        return {"error": self.message, "code": self.code}


class InvalidInputError(SpillwayError):
    """The request is malformed or does not match the model's signature."""

    status = 400
    code = "invalid_input"


class UnsupportedDatatypeError(InvalidInputError):
    """A datatype the protocol does not define, or the model does not accept."""

    code = "unsupported_datatype"


class BatchTooLargeError(InvalidInputError):
    """The request's own batch dimension exceeds what the model accepts."""

    code = "batch_too_large"


class NonFiniteInputError(InvalidInputError):
    """A floating-point input holds NaN or an infinity (or, as JSON, a number too large
    for its datatype) and the model does not declare that input as taking them: refused
    alike on every door, whether the value came as JSON, binary data or gRPC contents."""

    code = "non_finite_input"


class ModeUnavailableError(InvalidInputError):
    """The request asks for a serving mode this deployment does not offer (e.g. batch)."""

    code = "mode_unavailable"


class InvalidModelNameError(InvalidInputError):
    """A model name or version that could form an unsafe path or key."""

    code = "invalid_model_name"


class InputNotFoundError(InvalidInputError):
    """An object a request names as its input is not there (or cannot be read)."""

    code = "input_not_found"


class InvalidImageError(InvalidInputError):
    """An image input element that is not a whole JPEG or PNG image (another format, a
    corrupt or truncated file)."""

    code = "invalid_image"


class ImageTooLargeError(InvalidInputError):
    """An image whose header declares more pixels than the model's ``max_pixels``: refused
    before it is decoded, so a tiny file declaring a huge image (a decompression bomb)
    costs nothing. Its encoded bytes over ``max_bytes`` are a ``payload_too_large``."""

    code = "image_too_large"


class IdempotencyConflictError(SpillwayError):
    """An ``Idempotency-Key`` came back with another request (model, version or payload)
    than the one it first made."""

    status = 409
    code = "idempotency_conflict"


class ModelNotFoundError(SpillwayError):
    """No such model (or version) in the repository."""

    status = 404
    code = "model_not_found"

    @classmethod
    def unknown(cls, name: str, served: Iterable[str]) -> ModelNotFoundError:
        """The 404 of a name no model has, naming the models served here."""
        return cls(f"unknown model {name!r}; models served here: {name_list(served)}")


class SessionNotFoundError(SpillwayError):
    """No live session state under this id for this caller (absent, expired, or another
    caller's: the three are one answer, so ids reveal nothing)."""

    status = 404
    code = "session_not_found"


class VersionRolledBackError(SpillwayError):
    """A request pins a model version whose canary was rolled back, and the operator has
    not let pinned requests reach it (``spillway models canary --allow-pinned``)."""

    status = 409
    code = "version_rolled_back"


class PayloadTooLargeError(SpillwayError):
    """The body or a tensor exceeds a configured size cap."""

    status = 413
    code = "payload_too_large"


class UnsupportedMediaTypeError(SpillwayError):
    """A body in a content type or encoding the endpoint does not take (the local OTLP
    trace receiver takes Protobuf or JSON, plain or gzip)."""

    status = 415
    code = "unsupported_media_type"


class FanOutTooLargeError(SpillwayError):
    """A pipeline's mapped step would run more rows for one request than the step allows
    (``spillway.map.max_rows``: an OCR page with more text lines than a document has).
    Refused before the step runs; the request's own content caused it, so it never counts
    against a backend's health."""

    status = 413
    code = "fanout_too_large"


class RequestTimeoutError(SpillwayError):
    """The client did not send its request's head, or the next part of its body, within
    the server's time limit; the connection closes after this answer."""

    status = 408
    code = "request_timeout"


class OverloadedError(SpillwayError):
    """The queue is full; the client should retry after ``retry_after_s``."""

    status = 429
    code = "overloaded"


class DeadlineUnmeetableError(OverloadedError):
    """The device's queue ahead of the request is expected to outlast its deadline: it is
    refused at admission rather than left to time out (``Retry-After``: that wait). The
    router treats it as any 429 from a backend: it tries the next one."""

    code = "deadline_unmeetable"


class QuotaExceededError(SpillwayError):
    """The caller's tenant holds all its quota allows (sessions, work in flight, staged
    bytes); ``retry_after_s`` says when room may free up. The caller's own limit, never a
    fault of a backend."""

    status = 429
    code = "quota_exceeded"


class ModelNotReadyError(SpillwayError):
    """The model exists but cannot serve right now (loading, failed, evicted)."""

    status = 503
    code = "model_not_ready"


class UnavailableError(SpillwayError):
    """The server or a backend is shutting down or unreachable."""

    status = 503
    code = "unavailable"


class DeadlineExceededError(SpillwayError):
    """The request's deadline passed before it could be computed."""

    status = 504
    code = "deadline_exceeded"


class ModelLoadError(SpillwayError):
    """A model version could not be fetched, verified, loaded or warmed."""

    status = 500
    code = "model_load_failed"


class ChecksumMismatchError(ModelLoadError):
    """A downloaded model file does not match its recorded sha256."""

    code = "checksum_mismatch"


class InferenceError(SpillwayError):
    """The runtime failed while computing a batch."""

    status = 500
    code = "inference_failed"


class RouteNotFoundError(SpillwayError):
    """No such path."""

    status = 404
    code = "not_found"


class MethodNotAllowedError(SpillwayError):
    """The path exists but not for this HTTP method; ``allow`` names the one it takes."""

    status = 405
    code = "method_not_allowed"

    def __init__(self, message: str, *, allow: str | None = None) -> None:
        super().__init__(message)
        self.allow = allow


class InsufficientMemoryError(ModelNotReadyError):
    """A version cannot fit in the memory budget even after evicting idle versions."""

    code = "insufficient_memory"


class ControlDisabledError(SpillwayError):
    """Model control requests while the service runs without explicit model control."""

    status = 400
    code = "control_disabled"


class NotConfiguredError(SpillwayError):
    """The request needs a feature this deployment has not configured (session state
    without a state table): the caller's to know, like ``mode_unavailable``, never a 5xx."""

    status = 400
    code = "not_configured"


class UnauthorizedError(SpillwayError):
    """An admin operation without the admin token."""

    status = 401
    code = "unauthorized"


class UnauthenticatedError(UnauthorizedError):
    """A tenant-scoped request that nothing authenticated: no authorizer tenant, no API
    key or IAM principal, and the deployment does not accept tenant hints."""

    code = "unauthenticated"


class OutsideTenantAreaError(SpillwayError):
    """A location a request names lies outside the caller's own area: another tenant's
    data, the model repository, another feature's prefix or another bucket."""

    status = 403
    code = "outside_tenant_area"


# The batch job (``batch_job``): the jobs API and the records of a job's shards.


class JobNotFoundError(SpillwayError):
    """No job with this id."""

    status = 404
    code = "job_not_found"


class JobConflictError(SpillwayError):
    """The request clashes with an existing job (its key, its output prefix)."""

    status = 409
    code = "job_conflict"


class JobNotConfiguredError(SpillwayError):
    """A setting the jobs function needs is missing (e.g. the schedule's model): the
    deployment's fault, never the caller's, unlike ``not_configured``."""

    status = 500
    code = "job_not_configured"


class InputChangedError(SpillwayError):
    """A shard's input object is not the one the plan recorded (its ETag differs): running
    it would mix two versions of the input in one job's outputs."""

    status = 412
    code = "input_changed"


class RecordInputError(InvalidInputError):
    """A record that cannot be read, with its id when the id itself was readable."""

    def __init__(self, message: str, record_id: str | None = None) -> None:
        super().__init__(message)
        self.record_id = record_id


class DuplicateIdError(InvalidInputError):
    """A record whose id an earlier record of the shard already has."""

    code = "duplicate_id"


# WebSocket frames (``spillway.streams``): a frame's envelope, its connection and tenant.


class MessageTooLargeError(PayloadTooLargeError):
    """A frame larger than ``WS_MAX_MESSAGE_BYTES`` (or an answer that would be)."""

    code = "message_too_large"


class InvalidFrameError(InvalidInputError):
    """A frame whose envelope cannot be read (not a JSON object, a bad ``id``, ``seq`` or
    ``action``; an event marked base64, which API Gateway never sends): refused, its
    ``seq`` left open."""

    code = "invalid_frame"


class SlowDownError(SpillwayError):
    """More frames in flight on the connection than ``WS_MAX_IN_FLIGHT``: the frame is
    not processed; send it again after some answers arrive."""

    status = 429
    code = "slow_down"


class TooManyConnectionsError(QuotaExceededError):
    """The tenant holds ``WS_TENANT_MAX_CONNECTIONS`` connections already: ``$connect``
    is refused (API Gateway refuses the upgrade with this status)."""

    code = "too_many_connections"


class DuplicateSeqError(SpillwayError):
    """A ``seq`` already answered, or already held for this connection."""

    status = 409
    code = "duplicate_seq"


class SeqOutOfWindowError(SpillwayError):
    """A ``seq`` at least ``WS_MAX_IN_FLIGHT`` past the next one to deliver."""

    status = 400
    code = "seq_out_of_window"


class NotConnectedError(UnauthenticatedError):
    """A frame on a connection with no live state (never connected, closed, expired)."""

    code = "not_connected"


class StreamsNotConfiguredError(UnavailableError):
    """The WebSocket API runs without the state table its connections live in."""

    code = "websocket_not_configured"


# The shared state table (``spillway.state``).


class StateUnavailableError(UnavailableError):
    """The state table could not be read or written (throttled, unreachable, denied)."""


# The gRPC door (``gpu_service.grpc_server``, limits in ``gpu_service.grpc_limits``).


class GrpcLimitError(SpillwayError):
    """A call past one of the gRPC door's limits: ``RESOURCE_EXHAUSTED``, as gRPC itself
    answers a message over its size limit (the gRPC server maps this class so; its HTTP
    status alone would give ``UNAVAILABLE``)."""

    status = 429
    code = "too_many_rpcs"


class TooManyRpcsError(GrpcLimitError):
    """A peer (or all peers together) already has as many calls open as it may."""

    code = "too_many_rpcs"


class UnreadAnswersError(GrpcLimitError):
    """A stream's client took none of an answer within the write limit."""

    code = "unread_answers"


class IdleTimeoutError(RequestTimeoutError):
    """A stream with nothing in flight received nothing within its idle limit."""

    code = "idle_timeout"


class MalformedMessageError(InvalidInputError):
    """A gRPC message whose bytes are not the RPC's protobuf message."""

    code = "malformed_message"
