"""Adversarial clients on the WebSocket door, two tenants, on the local stack.

GIVEN the WebSocket API of the local stack (``spillway up``'s: the local API Gateway
stand-in running the WebSocket function) — WHEN acme floods one connection with 1,000
frames, or opens connections past its tenant's cap — THEN globex's frames are still
answered within 2 s, and globex still connects. WHEN acme sends what API Gateway refuses
(a binary frame, a frame over 32 KiB) THEN its connection is closed as API Gateway closes
it (1003, 1009), the frame never served, and globex's connection goes on.

A module of its own (beside ``test_adversarial.py``'s families): the session's ``stack``
sets the process's AWS variables when it starts, and a module that points boto3 at
another moto for its own duration must not be where it starts.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from spillway.aws.limits import WS_FRAME_BYTES
from spillway.streams.settings import StreamSettings
from tests.support import load_engine

WS_FLOOD = 1000
WS_FAIR_S = 2.0
"""How long globex's frame may wait while acme floods (the issue's bound, locally)."""


def _ws_digits(frame_id: str, image: list[float]) -> str:
    inputs = [{"name": "image", "shape": [1, 8, 8], "datatype": "FP32", "data": image}]
    return json.dumps({"id": frame_id, "model": "digits", "inputs": inputs})


async def _ws_flood(url: str, image: list[float]) -> tuple[list[float], dict[str, Any]]:
    async with aiohttp.ClientSession() as session:
        acme = await session.ws_connect(url, headers={"x-spillway-tenant": "acme"})
        globex = await session.ws_connect(url, headers={"x-spillway-tenant": "globex"})
        await globex.send_str(_ws_digits("warm", image))
        assert json.loads(await globex.receive_str(timeout=60))["id"] == "warm"
        for i in range(WS_FLOOD):
            await acme.send_str(_ws_digits(f"a{i}", image))

        async def drain() -> dict[str, Any]:
            """acme's replies until each frame has one, or none came for 60 s."""
            ids: Counter[str] = Counter()
            codes: Counter[str] = Counter()
            while sum(codes.values()) < WS_FLOOD:
                try:
                    reply = json.loads(await acme.receive_str(timeout=60))
                except TimeoutError:
                    break
                if "id" in reply:
                    ids[reply["id"]] += 1
                kind = reply.get("code") or reply.get("message") or "answered"
                codes["answered" if "outputs" in reply else kind] += 1
            return {"ids": ids, "codes": codes}

        drained = asyncio.ensure_future(drain())
        waits, labels = [], []
        for j in range(5):
            sent = time.monotonic()
            await globex.send_str(_ws_digits(f"g{j}", image))
            reply = json.loads(await globex.receive_str(timeout=120))
            waits.append(time.monotonic() - sent)
            assert reply["id"] == f"g{j}", reply
            labels.append({o["name"]: o["data"] for o in reply["outputs"]}["label"])
        got = await asyncio.wait_for(drained, 180)
        await acme.close()
        await globex.close()
        return waits, {**got, "labels": labels}


def test_websocket_flood_from_one_tenant_leaves_anothers_frames_answered(
    stack: Any, models_dir: Path
) -> None:
    image = np.load(models_dir / "digits/samples/images.npy").astype(np.float32)[0]
    label = load_engine(models_dir, "digits").infer({"image": image[None]})["label"]
    want = [int(label.ravel()[0])]
    # WHEN acme sends 1,000 frames on one connection at once, then globex 5, one at a time
    waits, got = asyncio.run(
        asyncio.wait_for(_ws_flood(stack.websocket_url, image.ravel().tolist()), 300)
    )
    # THEN every globex frame got its own right answer within the bound
    print(f"globex waits during the flood: {[round(w, 3) for w in waits]} s")
    assert got["labels"] == [want] * 5
    assert max(waits) < WS_FAIR_S, waits
    # AND every acme frame got exactly one reply: its answer, a slow_down, or API Gateway's
    # throttle frame (no id: the stand-in refused it before any invocation)
    ids, codes = got["ids"], got["codes"]
    assert set(ids.values()) <= {1}
    assert sum(codes.values()) == WS_FLOOD, codes
    assert set(codes) <= {"answered", "slow_down", "Too Many Requests"}, codes
    assert codes["answered"] + codes["slow_down"] == len(ids)


async def _ws_connect_many(url: str, tenant: str, count: int) -> tuple[list[Any], Counter[int]]:
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    opened: list[Any] = []
    refused: Counter[int] = Counter()

    async def one() -> None:
        try:
            opened.append(await session.ws_connect(url, headers={"x-spillway-tenant": tenant}))
        except aiohttp.WSServerHandshakeError as refusal:
            refused[refusal.status] += 1

    for start in range(0, count, 25):
        await asyncio.gather(*(one() for _ in range(min(25, count - start))))
    return [session, *opened], refused


async def _ws_past_the_cap(url: str, cap: int) -> dict[str, Any]:
    held, refused = await _ws_connect_many(url, "acme-conns", cap + 5)
    session, opened = held[0], held[1:]
    try:
        upgrade = {
            "Upgrade": "websocket",
            "Connection": "Upgrade",
            "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Key": base64.b64encode(os.urandom(16)).decode(),
            "x-spillway-tenant": "acme-conns",
        }
        async with session.get(url.replace("ws", "http", 1), headers=upgrade) as answer:
            body = json.loads(await answer.text())
        globex = await session.ws_connect(url, headers={"x-spillway-tenant": "globex-conns"})
        await globex.send_str(json.dumps({"id": "s", "action": "stats"}))
        stats = json.loads(await globex.receive_str(timeout=60))
        await globex.close()
    finally:
        for ws in opened:
            await ws.close()
        await session.close()
    return {"opened": len(opened), "refused": refused, "body": body, "stats": stats}


def test_websocket_connections_past_a_tenants_cap_leave_another_tenant_connecting(
    stack: Any,
) -> None:
    cap = StreamSettings().tenant_max_connections
    # WHEN acme opens 5 connections past its tenant's cap, then globex one
    got = asyncio.run(asyncio.wait_for(_ws_past_the_cap(stack.websocket_url, cap), 240))
    # THEN acme got exactly its cap, the rest refused 429 too_many_connections at $connect
    assert (got["opened"], got["refused"]) == (cap, Counter({429: 5}))
    assert got["body"]["code"] == "too_many_connections", got["body"]
    # AND globex's connection was accepted and serves frames
    assert got["stats"]["id"] == "s"
    assert got["stats"]["connection"]["frames_in"] == 1


async def _ws_refused(url: str, image: list[float]) -> dict[str, Any]:
    frame = _ws_digits("a0", image)
    refused: dict[str, tuple[str, bool]] = {"binary": (frame, True)}
    refused["a frame over 32 KiB"] = (frame + " " * WS_FRAME_BYTES, False)
    closes: dict[str, Any] = {}
    async with aiohttp.ClientSession() as session:
        globex = await session.ws_connect(url, headers={"x-spillway-tenant": "globex"})
        for what, (data, binary) in refused.items():
            acme = await session.ws_connect(url, headers={"x-spillway-tenant": "acme"})
            if binary:
                await acme.send_bytes(data.encode())
            else:
                await acme.send_str(data)
            # the first message back: the close, not an answer
            closes[what] = ((await acme.receive(timeout=60)).type, acme.close_code)
        await globex.send_str(_ws_digits("g0", image))
        reply = json.loads(await globex.receive_str(timeout=60))
        await globex.close()
    return {"closes": closes, "globex": reply}


def test_what_api_gateway_refuses_closes_the_connection_as_api_gateway_does(
    stack: Any, models_dir: Path
) -> None:
    image = np.load(models_dir / "digits/samples/images.npy").astype(np.float32)[0]
    # WHEN acme sends a digits frame as a binary frame on one connection, and as a text
    # frame padded past 32 KiB on another
    got = asyncio.run(
        asyncio.wait_for(_ws_refused(stack.websocket_url, image.ravel().tolist()), 120)
    )
    # THEN the first is closed with 1003 (unsupported data), the second with 1009 (too
    # big), neither answered
    assert got["closes"] == {
        "binary": (aiohttp.WSMsgType.CLOSE, 1003),
        "a frame over 32 KiB": (aiohttp.WSMsgType.CLOSE, 1009),
    }
    # AND globex's connection, open meanwhile, is served
    assert got["globex"]["id"] == "g0"
    assert "outputs" in got["globex"], got["globex"]
