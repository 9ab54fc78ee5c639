"""The WebSocket API on the local stack as ``spillway up`` starts it: ``spillway serve
websocket`` runs the WebSocket function with the router's environment, under the WSGI
router and, in the variant, beside the router under serverless-offline.

Two tenants (``x-spillway-tenant`` on ``$connect``: the local stack trusts tenant hints)
each stream 40 ``digits`` frames with ``seq`` (acme's each one WebSocket frame, globex's
each a message spanning several frames, as a message over API Gateway's 32 KiB frame
must) over their own connection, at once: every frame is answered
exactly once, in seq order, with its own id, and each label is ONNX Runtime's on the same
image; a frame refused with ``slow_down`` is sent again, as a client should. Each
connection's stats count its own frames only; a bad frame is answered 400 in its place
without disturbing the others; frames past the in-flight bound are told to slow down."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import onnxruntime as ort

from spillway.aws.limits import WS_FRAME_BYTES
from spillway_cli.local.stack import LocalStack
from spillway_cli.stream_drivers import send_text

FRAMES = 40
LIMIT = 32  # WS_MAX_IN_FLIGHT's default
WAIT_S = 180.0
RETRY = ("slow_down", "seq_out_of_window")
"""Refusals a client answers by sending the same frame again later."""
SPANNING = 256
"""The frame size globex's messages are sent in (each spans several frames)."""


@dataclass
class Stream:
    """What one connection received, in arrival order."""

    answers: list[dict[str, Any]] = field(default_factory=list)
    refused: list[dict[str, Any]] = field(default_factory=list)

    def ordered(self) -> list[dict[str, Any]]:
        """The answers of seq frames (the ordered stream), as they arrived."""
        return [a for a in self.answers if "seq" in a]


def _images(models_dir: Path) -> np.ndarray:
    images: np.ndarray = np.load(models_dir / "digits/samples/images.npy").astype(np.float32)
    return images


def _labels(models_dir: Path, images: np.ndarray) -> list[int]:
    """ONNX Runtime's labels, on the model file itself, one image a run (the graph takes
    the 8x8 image as 64 values)."""
    session = ort.InferenceSession(
        str(models_dir / "digits/1/model.onnx"), providers=["CPUExecutionProvider"]
    )
    name = session.get_inputs()[0].name
    runs = (session.run(["label"], {name: image.reshape(1, 64)})[0] for image in images)
    return [int(label.ravel()[0]) for label in runs]


def text_frame(frame_id: str, image: np.ndarray, seq: int | None = None) -> str:
    frame: dict[str, Any] = {
        "id": frame_id,
        "model": "digits",
        "inputs": [
            {
                "name": "image",
                "shape": [1, 8, 8],
                "datatype": "FP32",
                "data": image.ravel().tolist(),
            }
        ],
    }
    if seq is not None:
        frame["seq"] = seq
    return json.dumps(frame)


async def _send(ws: aiohttp.ClientWebSocketResponse, frame: str) -> None:
    """One message: in one WebSocket frame, or (globex's) in frames of ``SPANNING`` bytes."""
    await send_text(ws, frame, SPANNING if '"globex-' in frame else WS_FRAME_BYTES)


async def stream(
    ws: aiohttp.ClientWebSocketResponse,
    frames: Mapping[str, str],
    extra: int = 0,
    window: int | None = None,
) -> Stream:
    """Send the frames (all at once, or ``window`` at a time: one more as each answer
    comes) and read until each has its answer (and ``extra`` more answers came); a frame
    refused with ``slow_down`` or ``seq_out_of_window`` goes again after the next answer."""
    received = Stream()
    pending = set(frames)
    retry: list[str] = []
    unsent = list(frames.values())
    for frame in unsent[: window or len(unsent)]:
        await _send(ws, frame)
    del unsent[: window or len(unsent)]
    while pending or len(received.answers) < len(frames) + extra:
        answer = json.loads(await ws.receive_str(timeout=WAIT_S))
        if answer.get("code") in RETRY:
            received.refused.append(answer)
            retry.append(answer["id"])
            assert len(received.refused) < 50 * len(frames), "the client never got through"
            continue
        received.answers.append(answer)
        pending.discard(answer["id"])
        if unsent:
            await _send(ws, unsent.pop(0))
        for again in retry:
            await _send(ws, frames[again])
        retry.clear()
    return received


async def stats(ws: aiohttp.ClientWebSocketResponse, frame_id: str) -> dict[str, Any]:
    await ws.send_str(json.dumps({"id": frame_id, "action": "stats"}))
    answer = json.loads(await ws.receive_str(timeout=WAIT_S))
    assert answer["id"] == frame_id, answer
    connection: dict[str, Any] = answer["connection"]
    return connection


def _connect(session: aiohttp.ClientSession, url: str, tenant: str) -> Any:
    return session.ws_connect(url, headers={"x-spillway-tenant": tenant}, max_msg_size=0)


def _assert_served(received: Stream, want: list[int], prefix: str) -> None:
    """Exactly one answer a frame, in seq order, its own id, ONNX Runtime's label."""
    ordered = received.ordered()
    assert [a["seq"] for a in ordered] == list(range(len(want)))
    assert [a["id"] for a in ordered] == [f"{prefix}-{i}" for i in range(len(want))]
    for answer, label in zip(ordered, want, strict=True):
        assert "error" not in answer, answer
        assert answer["model_name"] == "digits"
        outputs = {o["name"]: o for o in answer["outputs"]}
        assert outputs["label"]["data"] == [label], answer["id"]
        assert answer["spillway"]["backend"] in ("gpu", "cpu")
    for refusal in received.refused:
        if refusal["code"] == "slow_down":
            assert (refusal["status"], refusal["limit"]) == (429, LIMIT), refusal


async def _two_tenants(url: str, models_dir: Path, window: int | None = None) -> dict[str, Any]:
    images = _images(models_dir)[: 2 * FRAMES]
    want = _labels(models_dir, images)
    acme = {f"acme-{i}": text_frame(f"acme-{i}", images[i], i) for i in range(FRAMES)}
    globex = {
        f"globex-{i}": text_frame(f"globex-{i}", images[FRAMES + i], i) for i in range(FRAMES)
    }
    wrong_shape = {"name": "image", "shape": [1, 8, 7], "datatype": "FP32", "data": [0.0] * 56}
    bad = {"id": "globex-bad", "model": "digits", "inputs": [wrong_shape]}
    async with (
        aiohttp.ClientSession() as session,
        _connect(session, url, "acme") as acme_ws,
        _connect(session, url, "globex") as globex_ws,
    ):
        # the bad frame goes first, in the middle of globex's stream's start
        await globex_ws.send_str(json.dumps(bad))
        acme_got, globex_got = await asyncio.gather(
            stream(acme_ws, acme, window=window),
            stream(globex_ws, globex, extra=1, window=window),
        )
        return {
            "want": want,
            "acme": acme_got,
            "globex": globex_got,
            "acme_stats": await stats(acme_ws, "acme-stats"),
            "globex_stats": await stats(globex_ws, "globex-stats"),
        }


def _check_two_tenants(got: dict[str, Any]) -> None:
    want = got["want"]
    _assert_served(got["acme"], want[:FRAMES], "acme")
    _assert_served(got["globex"], want[FRAMES:], "globex")
    # the bad frame was answered once, 400, outside the ordered stream
    bad = [a for a in got["globex"].answers if a["id"] == "globex-bad"]
    assert len(bad) == 1, bad
    assert (bad[0]["status"], bad[0]["code"]) == (400, "invalid_input"), bad
    assert "seq" not in bad[0]
    # each connection's accounting is its own frames only
    acme, globex = got["acme_stats"], got["globex_stats"]
    assert (acme["frames_answered"], acme["frames_failed"]) == (FRAMES, 0)
    assert (globex["frames_answered"], globex["frames_failed"]) == (FRAMES, 1)
    assert acme["frames_refused"] == len(got["acme"].refused)
    assert globex["frames_refused"] == len(got["globex"].refused)
    assert sum(acme["backends"].values()) == FRAMES
    assert acme["bytes_in"] > 0
    assert acme["bytes_out"] > 0
    assert acme["cost_usd"] > 0


def test_two_tenants_stream_digits_frames_in_order(stack: LocalStack, models_dir: Path) -> None:
    # WHEN acme and globex each stream 40 digits frames at once over their own connection,
    # globex's led by a frame whose image has the wrong shape
    got = asyncio.run(asyncio.wait_for(_two_tenants(stack.websocket_url, models_dir), WAIT_S))
    # THEN every frame was answered once, in seq order, with ONNX Runtime's label
    _check_two_tenants(got)


async def _over_the_bound(url: str, models_dir: Path) -> tuple[Stream, Stream, dict[str, Any]]:
    images = _images(models_dir)
    async with aiohttp.ClientSession() as session, _connect(session, url, "acme") as ws:
        # seq 1..31 are answered but held for seq 0: 31 frames in flight
        held = {f"held-{s}": text_frame(f"held-{s}", images[s], s) for s in range(1, LIMIT)}
        for frame in held.values():
            await ws.send_str(frame)
        in_flight = 0
        for attempt in range(600):  # until the 31 are admitted (the stats frame is one more)
            in_flight = (await stats(ws, f"gate-{attempt}"))["in_flight"]
            if in_flight >= LIMIT:
                break
            await asyncio.sleep(0.05)
        assert in_flight == LIMIT
        # WHEN 8 frames without seq arrive at once THEN those past the bound are refused
        burst = {f"burst-{i}": text_frame(f"burst-{i}", images[40 + i]) for i in range(8)}
        for frame in burst.values():
            await ws.send_str(frame)
        answers = [json.loads(await ws.receive_str(timeout=WAIT_S)) for _ in burst]
        served = [a for a in answers if a.get("code") != "slow_down"]
        burst_got = Stream(served, [a for a in answers if a.get("code") == "slow_down"])
        # AND seq 0 releases the 32 held answers, in order
        zero = {"held-0": text_frame("held-0", images[0], 0)}
        released = await stream(ws, zero, extra=LIMIT - 1)
        return burst_got, released, await stats(ws, "after")


def test_frames_past_the_bound_are_told_to_slow_down(stack: LocalStack, models_dir: Path) -> None:
    burst, released, after = asyncio.run(
        asyncio.wait_for(_over_the_bound(stack.websocket_url, models_dir), WAIT_S)
    )
    images = _images(models_dir)
    # each burst frame got exactly one answer: its label, or slow_down with the bound
    assert sorted(a["id"] for a in burst.answers + burst.refused) == [
        f"burst-{i}" for i in range(8)
    ]
    assert burst.refused, "no frame of the burst went past the bound"
    for refusal in burst.refused:
        assert (refusal["status"], refusal["limit"]) == (429, LIMIT), refusal
        assert refusal["in_flight"] >= LIMIT  # the frames in flight when it came
        assert "seq" not in refusal
    want = _labels(models_dir, images[40:48])
    for answer in burst.answers:
        i = int(answer["id"].split("-")[1])
        labels = {o["name"]: o["data"] for o in answer["outputs"]}["label"]
        assert labels == [want[i]], answer
    # the held answers came out in seq order once seq 0 was there
    assert [a["seq"] for a in released.ordered()] == list(range(LIMIT))
    assert [a["id"] for a in released.ordered()] == [f"held-{s}" for s in range(LIMIT)]
    assert after["frames_refused"] == len(burst.refused)
    assert after["in_flight"] == 1  # the stats frame itself


def test_under_serverless_offline_two_tenants_stream_in_order(
    offline_stack: LocalStack, models_dir: Path
) -> None:
    # the WebSocket API is `spillway serve websocket` beside the offline router too
    assert "websocket" in offline_stack.children
    url = offline_stack.websocket_url
    got = asyncio.run(asyncio.wait_for(_two_tenants(url, models_dir, window=3), WAIT_S))
    _check_two_tenants(got)
