"""The WebSocket API's events, served: ``$connect``, ``$disconnect`` and ``$default``.

``StreamGateway.handle`` takes one API Gateway WebSocket event (the Lambda handler's, or
the local gateway's) and answers it:

- ``$connect``: the caller's tenant, as the REST API resolves it; unauthenticated: 401
  (API Gateway refuses the upgrade); past the tenant's connection cap: 429
  ``too_many_connections``; else the connection's item, and 200.
- ``$disconnect``: the connection's item and held answers deleted; one log line with its
  accounting, and the same counters to ``on_close`` (the handler's metrics).
- ``$default``: one frame, exactly one answer pushed. A frame that is refused (not
  connected, too large, unreadable or marked base64 (a binary frame), over the in-flight
  bound, a duplicate or out-of-window ``seq``, over its tenant's frames in flight or frame
  rate) is answered at once, before it is routed. A frame without ``seq`` is answered when
  it is done. A frame with ``seq`` is pushed at once when it is next (under the
  connection's delivery lease, claimed for that ``seq``), else its answer is held; whoever
  finishes ``next_seq`` learns from that write whether the next answer is held and pushes
  it, so an answer held meanwhile is never stranded. An invocation near its end
  (``handover_reserve_s`` of its time left) hands the held answers over to another frame
  of the connection still being served, whose own hold pushes them: under a steady stream
  one invocation could otherwise push every answer for longer than API Gateway's 29 s.

``spillway.streams.delivery`` pushes the answers (``AnswerDelivery``, which the gateway
extends) and posts them (``ApiGatewayPoster``).

The router's call never raises out of ``handle``: a ``SpillwayError`` is the frame's
failure answer with its code, anything else is logged with its traceback and answered
``internal`` (500). A state table that cannot be reached before the frame is admitted is
its answer too (503 ``unavailable``, its ``seq`` left open); after, it is logged.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, cast

from spillway.policy.facts import Call
from spillway.protocol.errors import (
    DuplicateSeqError,
    NotConnectedError,
    SeqOutOfWindowError,
    SlowDownError,
    SpillwayError,
    StreamsNotConfiguredError,
    TooManyConnectionsError,
)
from spillway.protocol.replies import Reply, json_bytes
from spillway.protocol.wire import Target
from spillway.streams.connections import (
    OUT_OF_WINDOW,
    SLOW_DOWN,
    Connection,
    ConnectionStore,
)
from spillway.streams.delivery import AnswerDelivery, Destination, Poster, RetryingStore
from spillway.streams.frames import (
    Answer,
    Frame,
    RefusedFrame,
    frame_bytes,
    read_frame,
    routed,
)
from spillway.streams.settings import StreamSettings
from spillway.streams.tenants import RATE, FrameAdmission, TenantBudgets, frame_token

log = logging.getLogger("spillway.streams")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:=+/-]{1,128}$")


class RouterLike(Protocol):
    """What the gateway needs of ``spillway.router.dispatch.Router``."""

    def route(self, call: Call, target: Target) -> Reply:
        """The reply to one call."""
        ...


class TenantOf(Protocol):
    """``spillway.tenancy.identity.Authenticator``: the tenant of a ``$connect`` event."""

    def tenant(self, event: Mapping[str, object]) -> str | None:
        """The caller's tenant; ``UnauthenticatedError`` when nothing vouched for it."""
        ...


@dataclass(frozen=True)
class Event:
    """What the gateway reads off an API Gateway WebSocket event."""

    route: str
    connection_id: str
    endpoint: str
    request_id: str

    @classmethod
    def of(cls, event: Mapping[str, Any], configured: str | None) -> Event:
        """The event's route, connection and the ``@connections`` endpoint to post to."""
        context = event.get("requestContext") or {}
        endpoint = configured or f"https://{context.get('domainName')}/{context.get('stage')}"
        given = context.get("requestId")
        if not (isinstance(given, str) and _REQUEST_ID.fullmatch(given)):
            given = os.urandom(16).hex()
        return cls(
            route=str(context.get("routeKey") or "$default"),
            connection_id=str(context.get("connectionId") or ""),
            endpoint=endpoint,
            request_id=given,
        )


class StreamGateway(AnswerDelivery):
    """API Gateway WebSocket events to connections, frames and pushed answers."""

    def __init__(
        self,
        router: RouterLike,
        store: ConnectionStore | None,
        poster: Poster,
        settings: StreamSettings,
        authenticator: TenantOf,
        *,
        clock: Callable[[], float] = time.time,
        on_close: Callable[[Connection], None] | None = None,
        budgets: TenantBudgets | None = None,
    ) -> None:
        self.router = router
        self.store = store
        self.poster = poster
        self.settings = settings
        self.authenticator = authenticator
        self.clock = clock
        self.on_close = on_close
        self.budgets = budgets
        """Each tenant's connections, frames being served and frame rate (``None``: no
        per-tenant limits, as in the unit tests of the per-connection ones)."""

    def handle(self, event: Mapping[str, Any], remaining_ms: float | None = None) -> dict[str, Any]:
        """Serve one event; the answer API Gateway expects of the integration."""
        where = Event.of(event, self.settings.management_endpoint)
        if where.route == "$connect":
            return self._connect(event, where)
        if self.store is None:
            return _status(StreamsNotConfiguredError("no state table (ROUTER_STATE_TABLE)"))
        if where.route == "$disconnect":
            self._close(self.store, where, "disconnected")
        else:
            self._frame(self.store, event, where, remaining_ms)
        return {"statusCode": 200}

    # --- $connect / $disconnect --------------------------------------------------------

    def _connect(self, event: Mapping[str, Any], where: Event) -> dict[str, Any]:
        fields = {"connection_id": where.connection_id, "request_id": where.request_id}
        try:
            if self.store is None:
                raise StreamsNotConfiguredError(
                    "the WebSocket API needs the router's state table (ROUTER_STATE_TABLE)"
                )
            tenant = self.authenticator.tenant(event)
            self._count_in(tenant, where.connection_id)
            try:
                self.store.open(
                    where.connection_id, tenant, self.clock(), self.settings.connection_ttl_s
                )
            except SpillwayError:
                if self.budgets is not None:
                    self.budgets.disconnect(tenant, where.connection_id)
                raise
        except SpillwayError as error:
            log.info("refused", extra={**fields, "status": error.status, "code": error.code})
            return _status(error)
        log.info("connected", extra={**fields, "tenant": tenant})
        return {"statusCode": 200}

    def _count_in(self, tenant: str | None, connection_id: str) -> None:
        """Count a new connection in its tenant's (``TooManyConnectionsError`` at the cap)."""
        cap = self.settings.tenant_max_connections
        if self.budgets is not None and not self.budgets.connect(
            tenant, connection_id, self.clock(), cap
        ):
            raise TooManyConnectionsError(
                f"this tenant has {cap} connections open (WS_TENANT_MAX_CONNECTIONS): "
                "close one before opening another",
                retry_after_s=1.0,
            )

    def _close(self, store: ConnectionStore, where: Destination, why: str) -> None:
        last = store.close(where.connection_id, self.clock(), self.settings.max_in_flight)
        if last is None:
            return
        if self.budgets is not None:
            self.budgets.disconnect(last.tenant, where.connection_id)
        log.info(
            "connection closed",
            extra={"connection_id": where.connection_id, "why": why, "tenant": last.tenant}
            | last.stats(),
        )
        if self.on_close is not None:
            self.on_close(last)

    # --- $default ----------------------------------------------------------------------

    def _frame(
        self,
        store: ConnectionStore,
        event: Mapping[str, Any],
        where: Event,
        remaining_ms: float | None,
    ) -> None:
        accepted = self._accept(store, event, where)
        if accepted is None:
            return
        frame, connection = accepted
        token = self._tenant_admits(store, frame, connection, where)
        if token is None:
            return
        try:
            self._serve(store, frame, connection, where, remaining_ms)
        finally:
            self._release(connection.tenant, token)

    def _release(self, tenant: str | None, token: str) -> None:
        """Give the frame's slot back; one the table failed to give back is dropped once
        stale (``SLOT_STALE_S``)."""
        if self.budgets is None:
            return
        try:
            self.budgets.release(tenant, token)
        except SpillwayError as error:
            log.warning("tenant slot not released", extra={"reason": error.message})

    def _tenant_admits(
        self, store: ConnectionStore, frame: Frame, connection: Connection, where: Event
    ) -> str | None:
        """The frame's slot in its tenant's budget; ``None`` when it was refused (answered
        ``slow_down`` at once and taken back from its connection) or the table failed."""
        token = frame_token()
        if self.budgets is None:
            return token
        settings = self.settings
        try:
            admission = self.budgets.admit(
                connection.tenant,
                token,
                self.clock(),
                settings.tenant_max_in_flight,
                settings.tenant_frame_rate,
                settings.tenant_frame_burst,
            )
        except SpillwayError as error:  # the state table: the frame is not served
            answer = Answer.failed(error, frame.id, frame.seq)
        else:
            if admission.refusal is None:
                return token
            answer = self._over_budget(admission, frame)
        log.info("refused", extra={"connection_id": where.connection_id, "code": answer.code})
        cast(ConnectionStore, RetryingStore(store, self.retry_pauses_s)).withdraw(
            where.connection_id, frame.seq
        )
        self._push(store, where, answer)
        return None

    def _over_budget(self, admission: FrameAdmission, frame: Frame) -> Answer:
        """The ``slow_down`` answer of a frame past its tenant's frames in flight or rate."""
        settings = self.settings
        limit = settings.tenant_max_in_flight
        extra: dict[str, Any] = {"in_flight": admission.in_flight, "limit": limit}
        if admission.refusal == RATE:
            rate = f"{settings.tenant_frame_rate:g} frames/s"
            message = f"this tenant sends over its frame rate ({rate}): slow down"
            extra = {"retry_after_s": round(admission.retry_after_s, 3)}
        else:
            message = (
                f"too many frames of this tenant in flight (limit {limit}): "
                "wait for answers before sending more"
            )
        return RefusedFrame(SlowDownError(message), frame.id, frame.seq, **extra).answer()

    def _serve(
        self,
        store: ConnectionStore,
        frame: Frame,
        connection: Connection,
        where: Event,
        remaining_ms: float | None,
    ) -> None:
        """Route an admitted frame and deliver its answer."""
        # from when the held answers are handed over (None: the invocation has no end)
        hand_over_at = (
            None
            if remaining_ms is None
            else self.clock() + remaining_ms / 1000 - self.handover_reserve_s
        )
        answer = self._answer(store, frame, connection, where, remaining_ms)
        durable = cast(ConnectionStore, RetryingStore(store, self.retry_pauses_s))
        try:
            self._settle(durable, frame, answer, where, hand_over_at)
        except SpillwayError as error:  # the table failed after the frame was answered
            log.warning("settling failed", extra={"id": frame.id, "reason": error.message})

    def _accept(
        self, store: ConnectionStore, event: Mapping[str, Any], where: Event
    ) -> tuple[Frame, Connection] | None:
        """The frame and its connection, admitted; ``None`` when it was answered at once
        (refused, or the state table could not be reached)."""
        # isBase64Encoded: a binary frame, which API Gateway never hands over (it closes
        # the connection with 1003): refused invalid_frame, the body not decoded
        body, binary = event.get("body"), bool(event.get("isBase64Encoded"))
        size = len(body) if isinstance(body, str) else 0
        frame: Frame | None = None
        try:
            try:
                data = frame_bytes(body, binary, self.settings.max_message_bytes)
                size = len(data)
                frame = read_frame(data)
            except RefusedFrame:
                counts = {"frames_in": 1, "bytes_in": size, "frames_refused": 1}
                store.count(where.connection_id, counts)
                raise
            connection = self._admit(store, where.connection_id, frame, size)
        except RefusedFrame as refusal:
            self._push(store, where, refusal.answer())
            return None
        except SpillwayError as error:  # the state table
            log.warning("refused", extra={"status": error.status, "code": error.code})
            ids = (frame.id, frame.seq) if frame is not None else (None, None)
            self._push(store, where, Answer.failed(error, *ids))
            return None
        return frame, connection

    def _admit(
        self, store: ConnectionStore, connection_id: str, frame: Frame, size: int
    ) -> Connection:
        """Count the frame in: its connection as admitted (``RefusedFrame`` when the frame
        may not be served)."""
        limit = self.settings.max_in_flight
        token = os.urandom(12).hex()
        admission = store.admit(connection_id, size, limit, self.clock(), frame.seq, token)
        if admission is None:
            raise RefusedFrame(NotConnectedError("not connected"), frame.id, frame.seq)
        if admission.refusal == SLOW_DOWN:
            message = (
                f"too many frames in flight on this connection (limit {limit}): "
                "wait for answers before sending more"
            )
            raise RefusedFrame(
                SlowDownError(message),
                frame.id,
                frame.seq,
                in_flight=admission.in_flight,
                limit=limit,
            )
        next_seq = admission.connection.next_seq
        if admission.refusal == OUT_OF_WINDOW:
            error: SpillwayError = SeqOutOfWindowError(
                f"seq {frame.seq} is {limit} or more past the next seq to answer "
                f"({next_seq}): wait for answers before sending it"
            )
            raise RefusedFrame(error, frame.id, frame.seq)
        if admission.refusal is not None:
            error = DuplicateSeqError(f"seq {frame.seq} was already sent on this connection")
            raise RefusedFrame(error, frame.id, frame.seq)
        return admission.connection

    def _answer(
        self,
        store: ConnectionStore,
        frame: Frame,
        connection: Connection,
        where: Event,
        remaining_ms: float | None,
    ) -> Answer:
        """The frame's answer; never raises."""
        fields = {"connection_id": connection.id, "request_id": where.request_id, "id": frame.id}
        try:
            if frame.action == "stats":
                now = store.get(connection.id, self.clock())
                stats = (now or connection).stats()
                seq = {} if frame.seq is None else {"seq": frame.seq}
                return Answer({"id": frame.id, **seq, "connection": stats}, True)
            call, target = routed(frame, where.request_id, remaining_ms, connection.tenant)
            return Answer.of_reply(frame, self.router.route(call, target))
        except SpillwayError as error:
            log.info(
                "refused",
                extra={
                    **fields,
                    "status": error.status,
                    "code": error.code,
                    "reason": error.message,
                },
            )
            return Answer.failed(error, frame.id, frame.seq)
        except Exception:  # logged with its traceback, answered ``internal``
            log.exception("unhandled error", extra=fields)
            return Answer.failed(SpillwayError("internal error"), frame.id, frame.seq)


def _status(error: SpillwayError) -> dict[str, Any]:
    """A refused event's answer (on ``$connect`` API Gateway refuses the upgrade)."""
    return {"statusCode": error.status, "body": json_bytes(error.to_body()).decode()}
