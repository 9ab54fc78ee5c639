"""The frame-stream scenario's three doors, each driving S streams of F frames with W in
flight per stream, all in one event loop:

- the WebSocket API through the router: one connection a stream, ``seq`` on every frame,
  answers pushed in seq order; a ``slow_down`` answer sends the frame again shortly. Every
  frame is a text message (API Gateway closes the connection on a binary frame), an image
  file in it as base64 (``content_type`` ``base64``), and a message over 32 KiB goes in
  frames of 32 KiB (``send_text``);
- gRPC streams straight to the GPU service: one ``tritonclient.grpc`` client a stream,
  ``start_stream`` and ``async_stream_infer``, answers in request order; a stream that
  ends under its frames (the service was killed) reports the frames it had in flight as
  failed, and the frames after them as not sent (the client would send them again);
- HTTP through the router: each frame a POST, W at a time per stream (the baseline).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from spillway.aws.limits import WS_FRAME_BYTES
from spillway.protocol.codec import encode_request
from spillway_cli.frame_streams import (
    DoorRun,
    FrameSet,
    Progress,
    Scenario,
    StreamLog,
    batch_delta,
    gpu_stats,
    json_outputs,
)

if TYPE_CHECKING:
    from spillway_cli.local.stack import LocalStack

RESEND_AFTER_S = 0.05
"""How long a frame refused with ``slow_down`` waits before it is sent again."""
TENANTS = ("frames-a", "frames-b")
"""The tenants of the WebSocket streams, taken in turn (a connection's tenant is named on
``$connect``; locally by its ``x-spillway-tenant`` header)."""


@dataclass(frozen=True)
class Endpoints:
    """Where the doors are, and the router's headers (the local API key under
    serverless-offline)."""

    router_url: str
    gpu_url: str
    grpc_address: str
    websocket_url: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of_stack(cls, stack: LocalStack) -> Endpoints:
        return cls(
            router_url=stack.url("router"),
            gpu_url=stack.url("gpu"),
            grpc_address=f"127.0.0.1:{stack.ports.gpu_grpc}",
            websocket_url=stack.stack_env().get("SPILLWAY_WEBSOCKET_URL"),
            headers=dict(stack.router_headers),
        )


def gpu_killer(stack: LocalStack) -> Callable[[], None]:
    """A hook that SIGKILLs the stack's GPU service, by PID."""
    return lambda: stack.children["gpu"].signal(signal.SIGKILL)


def restart_gpu(stack: LocalStack) -> None:
    """Start the stack's GPU service again after it was killed (same ports)."""
    stack.children.pop("gpu").proc.wait(30)
    stack.start_gpu()


def run_door(
    door: str,
    endpoints: Endpoints,
    scenario: Scenario,
    frames: FrameSet,
    kill: Callable[[], None] | None = None,
    kill_share: float = 1 / 3,
) -> DoorRun:
    """Drive every stream of ``scenario`` through ``door``; ``kill`` (if given) is called
    once ``kill_share`` of the frames are settled."""
    drivers = {"websocket": _websocket, "grpc": _grpc, "http": _http}
    logs = [StreamLog(s, scenario.frames) for s in range(scenario.streams)]
    progress = Progress(max(1, int(scenario.total * kill_share)), kill)
    before = gpu_stats(endpoints.gpu_url, frames.model)
    started = time.monotonic()
    asyncio.run(_all(drivers[door], endpoints, scenario, frames, logs, progress))
    seconds = time.monotonic() - started
    after = gpu_stats(endpoints.gpu_url, frames.model)
    batches, inferences, executions = batch_delta(before, after)
    run = DoorRun(door, scenario, logs, seconds, batches, inferences, executions)
    run.killed_after, run.model, run.what = progress.fired_at, frames.model, frames.what
    return run


def _binary(tensors: dict[str, np.ndarray[Any, Any]]) -> bool:
    """Whether a frame must travel as binary data: a BYTES tensor (an image file) cannot
    be a V2 JSON string."""
    return any(tensor.dtype == np.object_ for tensor in tensors.values())


def _request(frames: FrameSet, log: StreamLog, seq: int) -> tuple[bytes, int | None]:
    """Frame ``seq`` as a V2 infer request body to the router (binary where it must be)
    asking for the frame set's outputs as JSON, with its parameters, and its header length
    (``None``: all JSON)."""
    tensors = frames.tensors(log.stream, seq, log.frames)
    return encode_request(
        tensors,
        binary=_binary(tensors),
        outputs=list(frames.outputs),
        parameters=frames.parameters or None,
    )


def websocket_message(frames: FrameSet, log: StreamLog, seq: int) -> str:
    """Frame ``seq`` as a WebSocket text message: the V2 request as JSON with the frame's
    id, model and seq; a BYTES input (an image file) as base64 strings."""
    body, _ = encode_request(
        frames.tensors(log.stream, seq, log.frames),
        binary=False,
        base64_bytes=True,
        outputs=list(frames.outputs),
        parameters=frames.parameters or None,
    )
    frame = {"id": f"s{log.stream}-f{seq}", "model": frames.model, "seq": seq}
    return json.dumps({**json.loads(body), **frame})


_TEXT, _CONTINUATION = 0x1, 0x0


async def send_text(
    ws: aiohttp.ClientWebSocketResponse, text: str, frame_bytes: int = WS_FRAME_BYTES
) -> None:
    """Send ``text`` as one message in frames of at most ``frame_bytes``: API Gateway
    closes the connection on a larger frame, and aiohttp sends a message as one frame
    (RFC 6455 section 5.4: a text frame without FIN, continuation frames, the last with
    FIN; a client masks each)."""
    data = text.encode()
    if len(data) <= frame_bytes:
        await ws.send_str(text)
        return
    # aiohttp writes no fragmented messages: its transport gets the frames, all written
    # before the next await, so no other message's frame comes between them
    transport = ws._writer.transport
    for start in range(0, len(data), frame_bytes):
        last = start + frame_bytes >= len(data)
        opcode = _TEXT if start == 0 else _CONTINUATION
        transport.write(_client_frame(data[start : start + frame_bytes], opcode, last))


def _client_frame(payload: bytes, opcode: int, fin: bool) -> bytes:
    """One masked client frame (RFC 6455 section 5.2)."""
    size = len(payload)
    if size < 126:
        length = bytes([0x80 | size])
    elif size < 65536:
        length = bytes([0x80 | 126]) + size.to_bytes(2, "big")
    else:
        length = bytes([0x80 | 127]) + size.to_bytes(8, "big")
    mask = os.urandom(4)
    key = (mask * (size // 4 + 1))[:size]
    masked = (int.from_bytes(payload, "big") ^ int.from_bytes(key, "big")).to_bytes(size, "big")
    return bytes([(0x80 if fin else 0) | opcode]) + length + mask + masked


@dataclass(frozen=True)
class _Shared:
    """What every stream of a run shares."""

    endpoints: Endpoints
    scenario: Scenario
    frames: FrameSet
    progress: Progress
    session: aiohttp.ClientSession


Driver = Callable[[_Shared, StreamLog], Coroutine[Any, Any, None]]


async def _all(
    driver: Driver,
    endpoints: Endpoints,
    scenario: Scenario,
    frames: FrameSet,
    logs: list[StreamLog],
    progress: Progress,
) -> None:
    """Every stream at once; those not done within the scenario's timeout are cancelled
    (their unanswered frames count as missing)."""
    limit = aiohttp.TCPConnector(limit=scenario.streams * scenario.window)
    timeout = aiohttp.ClientTimeout(total=scenario.timeout_s)
    async with aiohttp.ClientSession(connector=limit, timeout=timeout) as session:
        shared = _Shared(endpoints, scenario, frames, progress, session)
        tasks = [asyncio.create_task(driver(shared, log)) for log in logs]
        done, pending = await asyncio.wait(tasks, timeout=scenario.timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            task.result()


async def _websocket(run: _Shared, log: StreamLog) -> None:
    endpoints, frames, progress = run.endpoints, run.frames, run.progress
    if endpoints.websocket_url is None:
        raise RuntimeError("this stack serves no WebSocket API (no SPILLWAY_WEBSOCKET_URL)")
    window = asyncio.Semaphore(run.scenario.window)
    resends: set[asyncio.Task[None]] = set()
    answered: set[int] = set()
    tenant = {"x-spillway-tenant": TENANTS[log.stream % len(TENANTS)]}
    url, headers = endpoints.websocket_url, {**tenant, **endpoints.headers}
    async with run.session.ws_connect(url, headers=headers) as ws:

        async def send(seq: int, after_s: float = 0.0) -> None:
            await asyncio.sleep(after_s)
            log.sent_at.setdefault(seq, time.monotonic())
            await send_text(ws, websocket_message(frames, log, seq))

        async def sender() -> None:
            for seq in range(log.frames):
                await window.acquire()
                await send(seq)

        sending = asyncio.create_task(sender())
        try:
            async for message in ws:
                if message.type != aiohttp.WSMsgType.TEXT:
                    break
                answer = json.loads(message.data)
                if "id" not in answer:  # API Gateway's own frame: not an answer (ignored)
                    log.notices += 1
                    continue
                seq = answer.get("seq")
                if answer.get("code") == "slow_down" and isinstance(seq, int):
                    log.refused += 1  # still in its window slot: sent again shortly
                    task = asyncio.create_task(send(seq, RESEND_AFTER_S))
                    resends.add(task)
                    task.add_done_callback(resends.discard)
                    continue
                again = isinstance(seq, int) and seq in answered
                if "error" in answer or not isinstance(seq, int):
                    log.failed(str(answer.get("code", "no_seq")))
                else:
                    meta = answer.get("spillway") or {}
                    got = json_outputs(answer.get("outputs"))
                    right = frames.right(log.stream, seq, log.frames, got)
                    backend = str(meta.get("backend", "?"))
                    log.answered(seq, right, backend, meta.get("fallback"))
                    answered.add(seq)
                if not again:  # a second answer to a frame frees no slot and settles nothing
                    window.release()
                    progress.settle()
                if log.done >= log.frames:
                    break
        finally:
            sending.cancel()
            for task in resends:
                task.cancel()


async def _http(run: _Shared, log: StreamLog) -> None:
    endpoints, frames, progress = run.endpoints, run.frames, run.progress
    url = f"{endpoints.router_url}/v2/models/{frames.model}/infer"
    seqs = iter(range(log.frames))  # shared by the stream's W workers

    async def worker() -> None:
        for seq in seqs:
            log.sent_at[seq] = time.monotonic()
            body, length = _request(frames, log, seq)
            headers = {"Content-Type": "application/json", **endpoints.headers}
            if length is not None:
                headers["Content-Type"] = "application/octet-stream"
                headers["Inference-Header-Content-Length"] = str(length)
            try:
                async with run.session.post(url, data=body, headers=headers) as response:
                    raw = await response.read()
                    backend = response.headers.get("x-spillway-backend", "?")
                    fallback = response.headers.get("x-spillway-fallback")
                    status = response.status
            except (aiohttp.ClientError, TimeoutError) as exc:
                log.failed(type(exc).__name__)
            else:
                if status == 200:
                    got = json_outputs(json.loads(raw).get("outputs"))
                    right = frames.right(log.stream, seq, log.frames, got)
                    log.answered(seq, right, backend, fallback)
                else:
                    log.failed(_error_code(raw, status))
            progress.settle()

    await asyncio.gather(*(worker() for _ in range(run.scenario.window)))


def _error_code(raw: bytes, status: int) -> str:
    try:
        return str(json.loads(raw).get("code") or f"http_{status}")
    except (ValueError, AttributeError):
        return f"http_{status}"


async def _grpc(run: _Shared, log: StreamLog) -> None:
    endpoints, frames, progress = run.endpoints, run.frames, run.progress
    loop = asyncio.get_running_loop()
    stream = _GrpcStream(log, frames, progress, asyncio.Semaphore(run.scenario.window))
    client = grpcclient.InferenceServerClient(endpoints.grpc_address)
    client.start_stream(lambda result, error: loop.call_soon_threadsafe(stream.on, result, error))
    try:
        for seq in range(log.frames):
            await stream.window.acquire()
            if stream.ended.is_set() or not stream.send(client, seq):
                log.not_sent = log.frames - seq
                break
        stream.sending_done = True
        stream.check_settled()
        await stream.settled.wait()
    finally:
        await asyncio.to_thread(_close, client)


def _close(client: grpcclient.InferenceServerClient) -> None:
    client.stop_stream()
    client.close()


@dataclass
class _GrpcStream:
    """One gRPC stream's frames in flight; answers come in request order."""

    log: StreamLog
    frames: FrameSet
    progress: Progress
    window: asyncio.Semaphore
    outstanding: list[int] = field(default_factory=list)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    sending_done: bool = False

    def send(self, client: grpcclient.InferenceServerClient, seq: int) -> bool:
        """Queue frame ``seq`` on the stream; ``False`` when the stream has ended."""
        inputs = []
        for name, array in self.frames.tensors(self.log.stream, seq, self.log.frames).items():
            tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        wanted = [grpcclient.InferRequestedOutput(name) for name in self.frames.outputs]
        self.log.sent_at[seq] = time.monotonic()
        try:
            client.async_stream_infer(
                self.frames.model,
                inputs,
                request_id=f"s{self.log.stream}-f{seq}",
                outputs=wanted,
            )
        except InferenceServerException:
            del self.log.sent_at[seq]
            return False
        self.outstanding.append(seq)
        return True

    def on(self, result: grpcclient.InferResult | None, error: Exception | None) -> None:
        """One callback of the stream (on the event loop)."""
        if isinstance(error, InferenceServerException) and error.status() is not None:
            # The RPC itself ended (UNAVAILABLE when the service died): every frame in
            # flight is reported failed, none will be answered.
            self.log.failed_unanswered += len(self.outstanding)
            for _ in self.outstanding:
                self.progress.settle()
            self.outstanding.clear()
            self.ended.set()
            self.window.release()  # wakes the sender, which stops
        elif result is not None:
            seq = int(str(result.get_response().id).rsplit("-f", 1)[1])
            self.outstanding.remove(seq)
            got = {name: result.as_numpy(name) for name in self.frames.outputs}
            arrays = {name: array for name, array in got.items() if array is not None}
            right = self.frames.right(self.log.stream, seq, self.log.frames, arrays)
            self.log.answered(seq, right, "gpu", None)
            self._settle_one()
        elif self.outstanding:  # a frame's own error: answers come in order
            self.outstanding.pop(0)
            self.log.failed(_grpc_code(error))
            self._settle_one()
        self.check_settled()

    def _settle_one(self) -> None:
        self.window.release()
        self.progress.settle()

    def check_settled(self) -> None:
        if self.ended.is_set() or (self.sending_done and not self.outstanding):
            self.settled.set()


def _grpc_code(error: Exception | None) -> str:
    """The stable code the service puts in a gRPC error's message (``code: message``)."""
    text = str(error)
    head = text.split(":", 1)[0].strip()
    return head if head.replace("_", "").isalnum() and " " not in head else "grpc_error"
