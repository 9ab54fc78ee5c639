"""The gRPC door defends itself like the HTTP server (issue 32): per-peer slots, a stream's
idle and unread limits, malformed messages as INVALID_ARGUMENT with a code, messages
over the limit refused before they are parsed.

"Peer" is the client's address: the tests give each attacking peer its own address by
connecting through a small forwarder that binds its outgoing socket to 127.0.0.2,
127.0.0.3, … (all traffic stays on loopback, to 127.0.0.1)."""

from __future__ import annotations

import asyncio
import threading
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from spillway_cli.local import procs
from tests.fakes import eventually
from tests.support import Service, gpu_service, link_model

INFER = "/inference.GRPCInferenceService/ModelInfer"


class Forwarder:
    """TCP forwarders on 127.0.0.1 whose connections reach ``port`` from another loopback
    address each, so a service sees them as other peers. A thread runs their loop."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servers: list[asyncio.Server] = []

    def address_from(self, source: str) -> str:
        """A 127.0.0.1 address whose connections reach the service from ``source``."""
        future = asyncio.run_coroutine_threadsafe(self._listen(source), self.loop)
        return f"127.0.0.1:{future.result(10)}"

    async def _listen(self, source: str) -> int:
        async def forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            up_reader, up_writer = await asyncio.open_connection(
                "127.0.0.1", self.port, local_addr=(source, 0)
            )
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

        server = await asyncio.start_server(forward, "127.0.0.1", 0)
        self.servers.append(server)
        return int(server.sockets[0].getsockname()[1])

    def close(self) -> None:
        async def stop() -> None:
            for server in self.servers:
                server.close()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


def channel(address: str, tag: int = 0) -> grpc.aio.Channel:
    """An aio channel with its own connection (no subchannel shared with another)."""
    return grpc.aio.insecure_channel(
        address,
        options=[
            ("grpc.use_local_subchannel_pool", 1),
            ("spillway.test.channel", tag),
            ("grpc.max_send_message_length", -1),
        ],
    )


def digits_request(models: Path, rows: int = 1) -> Any:
    images = np.load(models / "digits" / "samples" / "images.npy")[:rows].astype(np.float32)
    request = service_pb2.ModelInferRequest(model_name="digits")
    request.inputs.add(name="image", datatype="FP32", shape=list(images.shape))
    request.raw_input_contents.append(images.tobytes())
    return request


def mlp_request(rows: int) -> Any:
    request = service_pb2.ModelInferRequest(model_name="mlp-bench")
    request.inputs.add(name="input", datatype="FP32", shape=[rows, 1024])
    request.raw_input_contents.append(np.ones((rows, 1024), np.float32).tobytes())
    return request


async def read_all(call: Any, answers: list[str]) -> None:
    """Read a stream's answers into ``answers`` (``OK`` or the error message) to its end."""
    async for answer in call:
        answers.append(answer.error_message or "OK")


def spillway_code(error: grpc.aio.AioRpcError) -> str | None:
    return dict(error.trailing_metadata() or ()).get("spillway-code")


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def grpc_calls(base: str, method: str, code: str) -> float:
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        text = response.read().decode()
    key = f'spillway_grpc_requests_total{{method="{method}",code="{code}"}} '
    return sum(float(line[len(key) :]) for line in text.splitlines() if line.startswith(key))


def _repo(models_dir: Path, tmp: pytest.TempPathFactory) -> Path:
    root = tmp.mktemp("grpc-limits-repo")
    for name in ("digits", "mlp-bench"):
        link_model(models_dir, root, name)
    return root


@pytest.fixture(scope="module")
def roomy(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """A service with the default gRPC limits (a 1 MiB message limit)."""
    port = procs.free_port()
    with gpu_service(
        _repo(models_dir, tmp_path_factory),
        tmp_path_factory.mktemp("grpc-roomy-logs"),
        grpc_port=str(port),
        grpc_max_message_bytes=str(1024 * 1024),
    ) as svc:
        svc.grpc = f"127.0.0.1:{port}"  # type: ignore[attr-defined]
        yield svc


@pytest.fixture(scope="module")
def strict(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """A service with short stream limits: idle 1 s, unread answers 2 s, messages 1 s."""
    port = procs.free_port()
    with gpu_service(
        _repo(models_dir, tmp_path_factory),
        tmp_path_factory.mktemp("grpc-strict-logs"),
        grpc_port=str(port),
        grpc_stream_idle_s="1",
        write_timeout_s="2",
        body_timeout_s="1",
        grpc_stream_window="4",
    ) as svc:
        svc.grpc = f"127.0.0.1:{port}"  # type: ignore[attr-defined]
        yield svc


def test_idle_streams_of_a_few_peers_leave_another_peers_infer_working(
    roomy: Service, models_dir: Path
) -> None:
    forwarder = Forwarder(_port(roomy))
    try:
        acme = [forwarder.address_from(f"127.0.0.{i}") for i in (2, 3, 4)]

        async def scenario() -> tuple[Counter[str], int, Any]:
            # GIVEN three acme peers opening 1,100 streams on 11 connections, sending nothing
            channels = [channel(acme[i % 3], i) for i in range(11)]
            calls = [
                service_pb2_grpc.GRPCInferenceServiceStub(ch).ModelStreamInfer()
                for ch in channels
                for _ in range(100)
            ]
            try:
                refused = await _settled(calls, expected=1100 - 3 * 128)
                # WHEN globex, another peer, calls ModelInfer while the streams stay open
                globex = channel(roomy.grpc, 99)  # type: ignore[attr-defined]
                stub = service_pb2_grpc.GRPCInferenceServiceStub(globex)
                answer = await stub.ModelInfer(digits_request(models_dir), timeout=20)
                open_now = sum(not c.done() for c in calls)
                await globex.close()
                return refused, open_now, answer
            finally:
                for call in calls:
                    call.cancel()
                for ch in channels:
                    await ch.close()

        refused, open_now, answer = asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        forwarder.close()
    # THEN each acme peer holds at most 128 streams, the rest refused with too_many_rpcs
    # (a few refused streams read CANCELLED on the client's side instead: 0-2 in most
    # runs, 4 of 716 in a full run on a loaded machine; no other code ever)
    assert open_now == 3 * 128
    assert refused.total() == 1100 - 3 * 128
    assert refused["RESOURCE_EXHAUSTED too_many_rpcs"] > refused.total() // 2
    assert set(refused) <= {"RESOURCE_EXHAUSTED too_many_rpcs", "CANCELLED None"}
    # AND globex is answered
    assert answer.model_name == "digits"
    assert len(answer.raw_output_contents) == 2


def _port(service: Service) -> int:
    return int(service.grpc.rpartition(":")[2])  # type: ignore[attr-defined]


async def _settled(calls: list[Any], expected: int) -> Counter[str]:
    """Wait until ``expected`` of ``calls`` have ended; their statuses and codes."""
    enough = asyncio.Event()

    def one_more(_: Any) -> None:
        if sum(c.done() for c in calls) >= expected:
            enough.set()

    for call in calls:
        call.add_done_callback(one_more)
    one_more(None)
    await enough.wait()
    ended: Counter[str] = Counter()
    for call in calls:
        if call.done():
            metadata = dict(await call.trailing_metadata() or ())
            ended[f"{(await call.code()).name} {metadata.get('spillway-code')}"] += 1
    return ended


def test_a_silent_stream_ends_at_its_idle_limit(strict: Service, models_dir: Path) -> None:
    async def scenario() -> tuple[list[str], Any, Any]:
        ch = channel(strict.grpc)  # type: ignore[attr-defined]
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        # GIVEN a stream that sends one request, reads its answer, then sends nothing
        call = stub.ModelStreamInfer()
        await call.write(digits_request(models_dir))
        answers: list[str] = []
        # WHEN it stays silent; THEN it ends after its idle limit, with the code
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await read_all(call, answers)
        # AND a stream that never sends anything ends the same way
        silent = stub.ModelStreamInfer()
        with pytest.raises(grpc.aio.AioRpcError) as never:
            await read_all(silent, [])
        await ch.close()
        return answers, ended.value, never.value

    answers, ended, never = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert answers == ["OK"]
    for error in (ended, never):
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert error.details().startswith("idle_timeout: ")
        assert spillway_code(error) == "idle_timeout"


def test_a_stream_whose_client_reads_nothing_is_ended(strict: Service) -> None:
    async def scenario() -> tuple[int, Any]:
        ch = channel(strict.grpc)  # type: ignore[attr-defined]
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        before = grpc_calls(strict.base, "ModelStreamInfer", "RESOURCE_EXHAUSTED")
        # GIVEN a stream sending 64 requests whose answers are 256 KiB each, reading none
        call = stub.ModelStreamInfer()
        request = mlp_request(64)

        async def send() -> None:
            for _ in range(64):
                await call.write(request)

        sender = asyncio.ensure_future(send())
        # WHEN its answers fill the flow-control windows for longer than the write limit
        # THEN the service ends the stream (counted in /metrics)
        await asyncio.to_thread(
            eventually,
            lambda: grpc_calls(strict.base, "ModelStreamInfer", "RESOURCE_EXHAUSTED") > before,
            "the stream ended for unread answers",
            timeout_s=30,
        )
        # AND a client that reads now gets the answers already sent, then the status
        answers: list[str] = []
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await read_all(call, answers)
        sender.cancel()
        await ch.close()
        return len(answers), ended.value

    answers, ended = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert answers < 64
    assert ended.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ended.details().startswith("unread_answers: ")
    assert spillway_code(ended) == "unread_answers"


def test_malformed_messages_are_invalid_argument_with_a_code(
    strict: Service, models_dir: Path
) -> None:
    async def scenario() -> tuple[list[Any], list[str]]:
        ch = channel(strict.grpc)  # type: ignore[attr-defined]
        raw = ch.unary_unary(INFER, request_serializer=bytes, response_deserializer=bytes)
        valid = digits_request(models_dir).SerializeToString()
        errors = []
        # GIVEN garbage bytes and a truncated message sent as ModelInfer
        for payload in (b"\xff\xfe\x00garbage\x12\x99", valid[:-7]):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await raw(payload, timeout=10)
            errors.append(refused.value)
        # AND a stream with a garbage message between two valid ones
        stream = ch.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            request_serializer=bytes,
            response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
        )

        async def requests() -> Any:
            for payload in (valid, b"\xff\xfe\x00", valid):
                yield payload

        answers = [a.error_message or "OK" async for a in stream(requests())]
        await ch.close()
        return errors, answers

    errors, answers = asyncio.run(asyncio.wait_for(scenario(), 30))
    # THEN each is INVALID_ARGUMENT with the code and no internal name
    for error in errors:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details().startswith("malformed_message: ")
        assert "<class" not in error.details()
        assert "DecodeError" not in error.details()
        assert spillway_code(error) == "malformed_message"
    # AND on the stream it is answered in its place while the others are served
    assert answers[0] == answers[2] == "OK"
    assert answers[1].startswith("malformed_message: ")


def test_a_unary_call_whose_message_never_comes_ends(strict: Service) -> None:
    async def scenario() -> Any:
        ch = channel(strict.grpc)  # type: ignore[attr-defined]
        # GIVEN a ModelInfer call opened without its message
        call = ch.stream_unary(INFER, request_serializer=bytes, response_deserializer=bytes)()
        # THEN it ends after the body time limit, as HTTP ends a body that stops
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await call
        await ch.close()
        return ended.value

    ended = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert ended.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert spillway_code(ended) == "request_timeout"


def test_huge_messages_are_refused_before_they_are_held(roomy: Service, models_dir: Path) -> None:
    pid = roomy.child.proc.pid
    before = rss_mb(pid)

    async def scenario() -> Counter[str]:
        # GIVEN 40 ModelInfer calls of 30 MB each at once, over the 1 MiB message limit
        channels = [channel(roomy.grpc, i) for i in range(4)]  # type: ignore[attr-defined]
        request = mlp_request(7680)

        async def one(i: int) -> str:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channels[i % 4])
            try:
                await stub.ModelInfer(request, timeout=60)
            except grpc.aio.AioRpcError as error:
                return str(error.code().name)
            return "OK"

        codes = Counter(await asyncio.gather(*(one(i) for i in range(40))))
        # AND the service still answers an ordinary request
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channels[0])
        await stub.ModelInfer(digits_request(models_dir), timeout=20)
        for ch in channels:
            await ch.close()
        return codes

    codes = asyncio.run(asyncio.wait_for(scenario(), 120))
    # THEN every one is refused by the size limit, and the service holds little of them
    assert codes == Counter({"RESOURCE_EXHAUSTED": 40})
    assert rss_mb(pid) - before < 400  # 40 x 30 MB held and parsed grew it by ~2 GB
