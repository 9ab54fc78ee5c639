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

The router's call never raises out of ``handle``: a ``SpillwayError`` is the frame's
failure answer with its code, anything else is logged with its traceback and answered
``internal`` (500). A state table that cannot be reached before the frame is admitted is
its answer too (503 ``unavailable``, its ``seq`` left open); after, it is logged.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
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
    StateUnavailableError,
    StreamsNotConfiguredError,
    TooManyConnectionsError,
)
from spillway.protocol.wire import Reply, Target, json_bytes
from spillway.streams.connections import (
    OUT_OF_WINDOW,
    SLOW_DOWN,
    Connection,
    ConnectionStore,
)
from spillway.streams.frames import (
    Answer,
    Frame,
    RefusedFrame,
    frame_bytes,
    read_frame,
    routed,
    too_large,
)
from spillway.streams.settings import StreamSettings
from spillway.streams.tenants import RATE, FrameAdmission, TenantBudgets, frame_token

log = logging.getLogger("spillway.streams")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:=+/-]{1,128}$")


class ConnectionGone(Exception):  # a state of the connection, not a fault
    """The connection an answer was posted to no longer exists (410 Gone)."""


class Poster(Protocol):
    """``post_to_connection``: push one text frame to a connection."""

    def post(self, endpoint: str, connection_id: str, data: bytes) -> None:
        """Push ``data``; ``ConnectionGone`` when the connection is gone."""
        ...


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


class ApiGatewayPoster:
    """``Poster`` over boto3's ``apigatewaymanagementapi``: one client per endpoint.

    A post is sent again only when it did not arrive: no connection made, throttled, or
    the connection closed before any answer came (a kept-alive connection the endpoint
    had just closed as idle: it reads no request from it). botocore's own retries are
    off, since a post whose answer timed out may have reached the client already, and
    sending it again would answer a frame twice. A post whose answer timed out counts as
    pushed (logged): never two answers, at the risk of none where the management API
    fails after taking the post."""

    def __init__(self, client_factory: Callable[[str], Any] | None = None) -> None:
        self._factory = client_factory or _management_client
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()

    def post(self, endpoint: str, connection_id: str, data: bytes) -> None:
        from spillway.aws.errors import (
            ClientError,
            ConnectionClosedError,
            ConnectionError,
            ReadTimeoutError,
            error_code,
            http_status,
        )

        client = self._client(endpoint)
        for attempt in range(_POST_ATTEMPTS):
            try:
                client.post_to_connection(ConnectionId=connection_id, Data=data)
                return
            except ReadTimeoutError:
                log.warning(
                    "post timed out: counted as pushed", extra={"connection_id": connection_id}
                )
                return
            except (ConnectionError, ConnectionClosedError):  # the post was not taken
                if attempt + 1 == _POST_ATTEMPTS:
                    raise
            except ClientError as exc:
                error = error_code(exc)
                status = http_status(exc)
                if error == "GoneException" or status == 410:
                    raise ConnectionGone(connection_id) from exc
                if status != 429 or attempt + 1 == _POST_ATTEMPTS:
                    raise
            time.sleep(0.05 * 2**attempt)

    def _client(self, endpoint: str) -> Any:
        with self._lock:
            if endpoint not in self._clients:
                self._clients[endpoint] = self._factory(endpoint)
            return self._clients[endpoint]


_POST_ATTEMPTS = 3


def _management_client(endpoint: str) -> Any:
    from spillway.aws.clients import client

    return client(
        "apigatewaymanagementapi",
        endpoint_url=endpoint,
        connect_timeout=1,
        read_timeout=5,
        max_attempts=None,
        total_max_attempts=1,
        retry_mode=None,
        max_pool_connections=64,
    )


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


class _Retrying:
    """A connection store whose calls are made again, after a pause, while the state table
    cannot be reached: once a frame is admitted its answer must reach the table (else it
    is never pushed, and with ``seq`` neither are the answers after it), and every call
    after admission is safe to repeat (a claim is its owner's again, a finish already done
    counts as done, a held answer is written again; only a retried hold may count the
    frame's counters twice)."""

    def __init__(self, store: ConnectionStore, pauses_s: tuple[float, ...]) -> None:
        self._store, self._pauses_s = store, pauses_s

    def __getattr__(self, name: str) -> Callable[..., Any]:
        call: Callable[..., Any] = getattr(self._store, name)

        def retried(*args: Any, **kwargs: Any) -> Any:
            for pause in self._pauses_s:
                try:
                    return call(*args, **kwargs)
                except StateUnavailableError:
                    log.warning("state table call failed: trying again", extra={"call": name})
                    time.sleep(pause)
            return call(*args, **kwargs)

        return retried


class StreamGateway:
    """API Gateway WebSocket events to connections, frames and pushed answers."""

    retry_pauses_s: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0)
    """Pauses before a state-table call after admission is made again."""
    handover_reserve_s: float = 4.0
    """The time an invocation keeps for pushing the held answers no other invocation
    will push (at most ``WS_MAX_IN_FLIGHT``): from then on it hands them over to another
    frame of the connection still being served."""

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

    def _close(self, store: ConnectionStore, where: Event, why: str) -> None:
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
        cast(ConnectionStore, _Retrying(store, self.retry_pauses_s)).withdraw(
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
        durable = cast(ConnectionStore, _Retrying(store, self.retry_pauses_s))
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

    def _settle(
        self,
        store: ConnectionStore,
        frame: Frame,
        answer: Answer,
        where: Event,
        hand_over_at: float | None,
    ) -> None:
        """Count the answer and push it: at once without ``seq``; with ``seq``, at once
        when it is next (the lease claimed: one write fails when it is not), else held
        for its turn; then the held answers after it (``_deliver``)."""
        counts = {"frames_answered" if answer.ok else "frames_failed": 1.0}
        counts["cost_usd"] = answer.cost_usd
        if frame.seq is None:
            sent = self._push(store, where, answer)
            counts.update(in_flight=-1, bytes_out=sent)
            store.count(where.connection_id, counts, answer.backend)
            return
        owner, seq = os.urandom(12).hex(), frame.seq
        now = self.clock()
        after: Connection | None = None
        if store.claim(where.connection_id, seq, owner, now, now + self.settings.lease_s):
            try:
                sent = self._post(where, answer.data)
            except ConnectionGone:
                self._close(store, where, "gone")
                return
            except Exception:  # held, and delivered again after a pause
                log.exception("push failed", extra={"connection_id": where.connection_id})
                self._hold(store, where, seq, answer, counts)
                store.release(where.connection_id, owner)
                self._deliver_again(store, where, owner, hand_over_at)
                return
            counts["bytes_out"] = sent
            now = self.clock()
            after = store.finish(
                where.connection_id, seq, owner, now, counts, answer.backend, held=False
            )
            if after is None:
                log.warning("delivery lease lost", extra={"connection_id": where.connection_id})
                return
        else:
            after = self._hold(store, where, seq, answer, counts)
        if not self._deliver(store, where, owner, after, hand_over_at):
            self._deliver_again(store, where, owner, hand_over_at)

    def _hold(
        self,
        store: ConnectionStore,
        where: Event,
        seq: int,
        answer: Answer,
        counts: dict[str, float],
    ) -> Connection | None:
        now, ttl = self.clock(), self.settings.held_ttl_s
        return store.hold(where.connection_id, seq, answer.data, now, ttl, counts, answer.backend)

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

    def _deliver(
        self,
        store: ConnectionStore,
        where: Event,
        owner: str,
        connection: Connection | None,
        hand_over_at: float | None = None,
    ) -> bool:
        """Push held answers from ``next_seq`` upward, ``connection`` being the item as the
        last write left it: one claim of the delivery lease per answer, taken just before
        its post (``WS_LEASE_S`` outlasts a post, so no other call can claim the same
        ``seq`` while it is being pushed) and given back by the ``finish`` after it, whose
        result says whether the next answer is held. A call that finds the lease taken
        leaves: the holder's next ``finish`` shows it the answer held meanwhile, so none is
        stranded. From ``hand_over_at`` on, a call leaves while another frame is being
        served: that frame's hold finds the lease free and the next answer held, and
        pushes it. ``False`` when a post failed (its answer stays held)."""
        while connection is not None and connection.next_is_held():
            seq, now = connection.next_seq, self.clock()
            if connection.leased(owner, now):
                return True
            if hand_over_at is not None and now >= hand_over_at and connection.serving():
                log.info(
                    "held answers handed over",
                    extra={"connection_id": where.connection_id, "next_seq": seq},
                )
                return True
            fields = {"connection_id": where.connection_id, "seq": seq}
            data = store.held(where.connection_id, seq, now)
            if data is None:  # pushed meanwhile by another invocation, which goes on
                log.debug("held answer already pushed", extra=fields)
                return True
            if not store.claim(where.connection_id, seq, owner, now, now + self.settings.lease_s):
                log.debug("delivery left to the lease holder", extra=fields)
                return True
            try:
                sent = self._post(where, data)
            except ConnectionGone:
                self._close(store, where, "gone")
                return True
            except Exception:  # the answer stays held
                log.exception("push failed", extra={"connection_id": where.connection_id})
                store.release(where.connection_id, owner)
                return False
            now = self.clock()
            connection = store.finish(where.connection_id, seq, owner, now, {"bytes_out": sent})
            if connection is None:
                log.warning("delivery lease lost", extra=fields)
        return True

    def _deliver_again(
        self, store: ConnectionStore, where: Event, owner: str, hand_over_at: float | None
    ) -> None:
        """After a post failed: the held answers delivered again, after pauses, while one
        is next (a client that waits for that answer before sending more would otherwise
        wait for good). Left held, for the next frame's invocation, when every try fails or
        the next pause would pass the invocation's end."""
        end = None if hand_over_at is None else hand_over_at + self.handover_reserve_s
        for pause in self.retry_pauses_s:
            if end is not None and self.clock() + pause >= end:
                break
            time.sleep(pause)
            connection = store.get(where.connection_id, self.clock())
            if self._deliver(store, where, owner, connection, hand_over_at):
                return
        log.error(
            "answer left held: its pushes failed",
            extra={"connection_id": where.connection_id},
        )

    def _push(self, store: ConnectionStore, where: Event, answer: Answer) -> int:
        """Push an answer out of order; the bytes sent. A gone connection is closed; a
        push that failed otherwise is made again after pauses, and logged as lost when
        every try failed (nothing holds an answer without ``seq``)."""
        for pause in (0.0, *self.retry_pauses_s):
            time.sleep(pause)
            try:
                return self._post(where, answer.data)
            except ConnectionGone:
                self._close(store, where, "gone")
                return 0
            except Exception:  # logged with its traceback
                log.exception("push failed", extra={"connection_id": where.connection_id})
        log.error("answer lost: its pushes failed", extra={"connection_id": where.connection_id})
        return 0

    def _post(self, where: Event, data: bytes) -> int:
        """Post one answer (one over the message limit is replaced by its 413); the bytes
        sent."""
        limit = self.settings.max_message_bytes
        if len(data) > limit:
            document = json.loads(data)
            error = too_large(len(data), limit, "answer")
            data = Answer.failed(error, document.get("id"), document.get("seq")).data
        self.poster.post(where.endpoint, where.connection_id, data)
        return len(data)


def _status(error: SpillwayError) -> dict[str, Any]:
    """A refused event's answer (on ``$connect`` API Gateway refuses the upgrade)."""
    return {"statusCode": error.status, "body": json_bytes(error.to_body()).decode()}
