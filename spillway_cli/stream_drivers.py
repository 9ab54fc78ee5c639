"""The frame-stream scenario's three doors, each driving S streams of F frames with W in
flight per stream, all in one event loop:

- the WebSocket API through the router: one connection a stream, ``seq`` on every frame,
  answers pushed in seq order; a ``slow_down`` answer sends the frame again shortly;
- gRPC streams straight to the GPU service: one ``tritonclient.grpc`` client a stream,
  ``start_stream`` and ``async_stream_infer``, answers in request order; a stream that
  ends under its frames (the service was killed) reports the frames it had in flight as
  failed, and the frames after them as not sent (the client would send them again);
- HTTP through the router: each frame a POST, W at a time per stream (the baseline).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from spillway_cli.frame_streams import (
    MODEL,
    DoorRun,
    Frames,
    Progress,
    Scenario,
    StreamLog,
    batch_delta,
    gpu_stats,
)

if TYPE_CHECKING:
    from spillway_cli.stack import LocalStack

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
    frames: Frames,
    kill: Callable[[], None] | None = None,
    kill_share: float = 1 / 3,
) -> DoorRun:
    """Drive every stream of ``scenario`` through ``door``; ``kill`` (if given) is called
    once ``kill_share`` of the frames are settled."""
    drivers = {"websocket": _websocket, "grpc": _grpc, "http": _http}
    logs = [StreamLog(s, scenario.frames) for s in range(scenario.streams)]
    progress = Progress(max(1, int(scenario.total * kill_share)), kill)
    before = gpu_stats(endpoints.gpu_url)
    started = time.monotonic()
    asyncio.run(_all(drivers[door], endpoints, scenario, frames, logs, progress))
    seconds = time.monotonic() - started
    batches, inferences, executions = batch_delta(before, gpu_stats(endpoints.gpu_url))
    run = DoorRun(door, scenario, logs, seconds, batches, inferences, executions)
    run.killed_after = progress.fired_at
    return run


@dataclass(frozen=True)
class _Shared:
    """What every stream of a run shares."""

    endpoints: Endpoints
    scenario: Scenario
    frames: Frames
    progress: Progress
    session: aiohttp.ClientSession


Driver = Callable[[_Shared, StreamLog], Coroutine[Any, Any, None]]


async def _all(
    driver: Driver,
    endpoints: Endpoints,
    scenario: Scenario,
    frames: Frames,
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


def _label(outputs: list[dict[str, Any]]) -> int:
    return int(next(o for o in outputs if o["name"] == "label")["data"][0])


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
            frame = {"id": f"s{log.stream}-f{seq}", "model": MODEL, "seq": seq}
            await ws.send_str(
                json.dumps({**frame, **frames.v2_inputs(log.stream, seq, log.frames)})
            )

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
                    expected = frames.expected(log.stream, seq, log.frames)
                    label = _label(answer["outputs"])
                    backend = str(meta.get("backend", "?"))
                    log.answered(seq, label, backend, meta.get("fallback"), expected)
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
    url = f"{endpoints.router_url}/v2/models/{MODEL}/infer"
    seqs = iter(range(log.frames))  # shared by the stream's W workers

    async def worker() -> None:
        for seq in seqs:
            log.sent_at[seq] = time.monotonic()
            body = frames.v2_inputs(log.stream, seq, log.frames)
            try:
                async with run.session.post(url, json=body, headers=endpoints.headers) as response:
                    raw = await response.read()
                    backend = response.headers.get("x-spillway-backend", "?")
                    fallback = response.headers.get("x-spillway-fallback")
                    status = response.status
            except (aiohttp.ClientError, TimeoutError) as exc:
                log.failed(type(exc).__name__)
            else:
                if status == 200:
                    label = _label(json.loads(raw)["outputs"])
                    expected = frames.expected(log.stream, seq, log.frames)
                    log.answered(seq, label, backend, fallback, expected)
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
    frames: Frames
    progress: Progress
    window: asyncio.Semaphore
    outstanding: list[int] = field(default_factory=list)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    sending_done: bool = False

    def send(self, client: grpcclient.InferenceServerClient, seq: int) -> bool:
        """Queue frame ``seq`` on the stream; ``False`` when the stream has ended."""
        image = self.frames.image(self.log.stream, seq, self.log.frames)
        tensor = grpcclient.InferInput("image", list(image.shape), "FP32")
        tensor.set_data_from_numpy(image)
        wanted = [grpcclient.InferRequestedOutput("label")]
        self.log.sent_at[seq] = time.monotonic()
        try:
            client.async_stream_infer(
                MODEL, [tensor], request_id=f"s{self.log.stream}-f{seq}", outputs=wanted
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
            label = int(result.as_numpy("label").ravel()[0])
            expected = self.frames.expected(self.log.stream, seq, self.log.frames)
            self.log.answered(seq, label, "gpu", None, expected)
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
