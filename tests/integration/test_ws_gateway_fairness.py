"""The local WebSocket gateway shares its threads (the function's concurrency) between
connections: one connection's flood runs on at most ``connection_workers`` threads and
waits in a bounded queue of its own, so another connection's message is invoked at once;
past the queue, or past the stage's throttle, a message gets API Gateway's ``Too Many
Requests`` frame and no invocation."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from typing import Any

import aiohttp
from aiohttp import web

from spillway_cli.local import procs
from spillway_cli.local.websocket.gateway import WebSocketGateway
from spillway_cli.local.websocket.throttle import TokenBucket


class GatedHandler:
    """``$default`` of connection A waits for ``gate``; B's sets ``b_ran``. Counts the
    invocations of each connection running at once, and every message seen."""

    def __init__(self) -> None:
        self.gate, self.b_ran = threading.Event(), threading.Event()
        self.lock = threading.Condition()
        self.running: Counter[str] = Counter()
        self.most: Counter[str] = Counter()
        self.seen: list[str] = []

    def __call__(self, event: dict[str, Any], context: Any) -> dict[str, Any]:
        if event["requestContext"]["routeKey"] != "$default":
            return {"statusCode": 200}
        who = json.loads(event["body"])["who"]
        with self.lock:
            self.seen.append(who)
            self.running[who] += 1
            self.most[who] = max(self.most[who], self.running[who])
        try:
            if who == "a":
                assert self.gate.wait(30)
            else:
                self.b_ran.set()
        finally:
            with self.lock:
                self.running[who] -= 1
                self.lock.notify_all()
        return {"statusCode": 200}


async def _flood(handler: GatedHandler, gateway: WebSocketGateway) -> dict[str, Any]:
    runner = web.AppRunner(gateway.app())
    await runner.setup()
    port = procs.free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    loop = asyncio.get_running_loop()
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(f"ws://127.0.0.1:{port}/") as a,
            session.ws_connect(f"ws://127.0.0.1:{port}/") as b,
        ):
            # WHEN A sends 50 messages at once (its invocations all stuck), then B one
            for _ in range(50):
                await a.send_str('{"who": "a"}')
            notices = [json.loads(await a.receive_str(timeout=30)) for _ in range(32)]
            await b.send_str('{"who": "b"}')
            b_ran = await loop.run_in_executor(None, handler.b_ran.wait, 10)
            handler.gate.set()
            seen = await loop.run_in_executor(None, _until_seen, handler, 19)
            return {"b_ran": b_ran, "notices": notices, "seen": seen}
    finally:
        handler.gate.set()
        await runner.cleanup()


def _until_seen(handler: GatedHandler, count: int) -> list[str]:
    """The messages seen, once ``count`` were and none is running (or after 20 s)."""
    with handler.lock:
        handler.lock.wait_for(
            lambda: len(handler.seen) >= count and not any(handler.running.values()), 20
        )
        return list(handler.seen)


def test_a_flooding_connection_leaves_threads_for_another_connection() -> None:
    # GIVEN a gateway of 4 threads, 2 a connection, 16 messages queued a connection
    handler = GatedHandler()
    gateway = WebSocketGateway(handler, workers=4, connection_workers=2, max_queued=16)
    got = asyncio.run(asyncio.wait_for(_flood(handler, gateway), 60))
    # THEN B's message was invoked while A's were all stuck
    assert got["b_ran"]
    # AND A never held more than its 2 threads
    assert handler.most == Counter({"a": 2, "b": 1})
    # AND A's messages past its 2 running and 16 queued got API Gateway's throttle frame
    assert {n["message"] for n in got["notices"]} == {"Too Many Requests"}
    assert {frozenset(n) for n in got["notices"]} == {
        frozenset({"message", "connectionId", "requestId"})
    }
    # AND every other message of A was invoked once its turn came
    assert Counter(got["seen"]) == Counter({"a": 18, "b": 1})


def test_the_stage_throttle_is_a_token_bucket() -> None:
    # GIVEN 2 tokens a second, a burst of 3, and a clock the test moves
    now = [100.0]
    bucket = TokenBucket(2.0, 3, clock=lambda: now[0])
    # WHEN 4 messages come at once THEN the burst passes and the fourth is throttled
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]
    # AND half a second later one more passes, not two
    now[0] += 0.5
    assert [bucket.take() for _ in range(2)] == [True, False]
    # AND after a long quiet only the burst is saved
    now[0] += 60
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]
