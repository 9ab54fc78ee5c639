"""A WebSocket connection's answers, pushed: in ``seq`` order, each exactly once.

``ApiGatewayPoster`` posts one answer to ``@connections`` (``ConnectionGone`` when the
connection is gone). ``AnswerDelivery``, the half of ``StreamGateway`` that delivers,
settles a served frame's answer: without ``seq`` it is pushed at once; with ``seq`` it is
pushed at once when it is next (under the connection's delivery lease, claimed for that
``seq``), else held; whoever finishes ``next_seq`` learns from that write whether the
next answer is held and pushes it, so an answer held meanwhile is never stranded. An
invocation near its end (``handover_reserve_s`` of its time left) hands the held answers
over to another frame of the connection still being served, whose own hold pushes them.
A push that failed is made again after pauses, and so is every state-table call after a
frame's admission (``RetryingStore``): its answer must reach the table.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from spillway.protocol.errors import StateUnavailableError
from spillway.streams.connections import Connection, ConnectionStore
from spillway.streams.frames import Answer, Frame, too_large
from spillway.streams.settings import StreamSettings

log = logging.getLogger("spillway.streams")


class ConnectionGone(Exception):  # a state of the connection, not a fault
    """The connection an answer was posted to no longer exists (410 Gone)."""


class Poster(Protocol):
    """``post_to_connection``: push one text frame to a connection."""

    def post(self, endpoint: str, connection_id: str, data: bytes) -> None:
        """Push ``data``; ``ConnectionGone`` when the connection is gone."""
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


class Destination(Protocol):
    """Where a frame's answers go: its connection, and the ``@connections`` endpoint."""

    @property
    def connection_id(self) -> str:
        """The connection API Gateway named."""
        ...

    @property
    def endpoint(self) -> str:
        """The ``@connections`` endpoint to post to."""
        ...


class RetryingStore:
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


class AnswerDelivery:
    """Settling and pushing a connection's answers: the half of ``StreamGateway`` that
    delivers (it gives ``poster``, ``settings``, ``clock`` and ``_close``)."""

    retry_pauses_s: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0)
    """Pauses before a state-table call after admission is made again."""
    handover_reserve_s: float = 4.0
    """The time an invocation keeps for pushing the held answers no other invocation
    will push (at most ``WS_MAX_IN_FLIGHT``): from then on it hands them over to another
    frame of the connection still being served."""

    poster: Poster
    settings: StreamSettings
    clock: Callable[[], float]

    def _close(self, store: ConnectionStore, where: Destination, why: str) -> None:
        """Delete a connection found gone, with its accounting (``StreamGateway``'s)."""
        raise NotImplementedError

    def _settle(
        self,
        store: ConnectionStore,
        frame: Frame,
        answer: Answer,
        where: Destination,
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
        where: Destination,
        seq: int,
        answer: Answer,
        counts: dict[str, float],
    ) -> Connection | None:
        now, ttl = self.clock(), self.settings.held_ttl_s
        return store.hold(where.connection_id, seq, answer.data, now, ttl, counts, answer.backend)

    def _deliver(
        self,
        store: ConnectionStore,
        where: Destination,
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
        self, store: ConnectionStore, where: Destination, owner: str, hand_over_at: float | None
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

    def _push(self, store: ConnectionStore, where: Destination, answer: Answer) -> int:
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

    def _post(self, where: Destination, data: bytes) -> int:
        """Post one answer (one over the message limit is replaced by its 413); the bytes
        sent."""
        limit = self.settings.max_message_bytes
        if len(data) > limit:
            document = json.loads(data)
            error = too_large(len(data), limit, "answer")
            data = Answer.failed(error, document.get("id"), document.get("seq")).data
        self.poster.post(where.endpoint, where.connection_id, data)
        return len(data)
