"""A model published to the repository after the service started (without a load
request) is served by its first request, on every door: the miss waits for one listing
of the repository, shared by every miss before it begins, at most one a second.

The registry's clock and sleep are the test's (a sleep moves the clock at once); the
listing is gated where a test needs it held. Nothing here waits a fixed time."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from gpu_service.dataplane import DataPlane
from gpu_service.grpc_server import InferenceService
from gpu_service.http import GpuServiceApp
from gpu_service.registry import MISS_LIST_S, ModelRegistry
from gpu_service.settings import GpuSettings
from spillway.protocol.errors import ModelNotFoundError, UnavailableError
from tests.fakes import FakeRepository, StepClock
from tests.unit.test_stats import plus_loader
from tests.unit.test_transport_protocol import LIMITS, Harness, infer_body, request

WAIT_S = 10.0
"""Generous bound on a wait for something that should happen at once; a hang fails here."""


class ListingRepository(FakeRepository):
    """Records when (on ``clock``) each listing began; with a ``gate``, a listing waits
    until it is set; with ``failing``, a listing fails."""

    clock: StepClock
    gate: threading.Event | None = None
    failing = False

    def __init__(self, root: Path, clock: StepClock) -> None:
        super().__init__(root)
        self.clock = clock
        self.began: list[float] = []

    def list_models(self) -> list[str]:
        self.began.append(self.clock.now)
        if self.gate is not None:
            assert self.gate.wait(WAIT_S)
        if self.failing:
            raise UnavailableError("the repository is unreachable")
        return super().list_models()


@asynccontextmanager
async def started(tmp_path: Path) -> AsyncIterator[tuple[ListingRepository, DataPlane]]:
    """A data plane over a registry started while the repository held ``m`` alone."""
    clock = StepClock()
    repo = ListingRepository(tmp_path, clock)
    repo.add("m", 1)
    settings = GpuSettings(**LIMITS)
    registry = ModelRegistry(repo, settings, loader=plus_loader, clock=clock, sleep=clock.sleep)
    await registry.start()
    plane = DataPlane(registry, settings)
    try:
        yield repo, plane
    finally:
        if repo.gate is not None:
            repo.gate.set()
        await registry.stop(5)
        plane.close()


def answer_of(model: str, y: float) -> dict[str, Any]:
    """What ``y = x + 1`` (version 1 of any model here) answers."""
    output = {"name": "y", "datatype": "FP32", "shape": [1, 1], "data": [y]}
    return {"model_name": model, "model_version": "1", "outputs": [output]}


def test_http_first_request_for_a_newly_published_model_is_served(tmp_path: Path) -> None:
    async def main() -> None:
        async with started(tmp_path) as (repo, plane):
            client = Harness(GpuServiceApp(plane)).connect()
            # GIVEN a model published after start, nobody asking the service to load it
            repo.add("new", 1)
            listings = len(repo.began)
            # WHEN the first request names it (on the service's own HTTP server)
            client.send(request("POST", "/v2/models/new/infer", infer_body(2.0)))
            await client.settle()
            # THEN it is served by the model (y = x + 1), after one listing
            [(status, _, body)] = client.answers()
            assert (status, json.loads(body)) == (200, answer_of("new", 3.0))
            assert len(repo.began) == listings + 1

    asyncio.run(main())


def test_asgi_first_request_for_a_newly_published_model_is_served(tmp_path: Path) -> None:
    async def main() -> None:
        async with started(tmp_path) as (repo, plane):
            repo.add("new", 1)
            payload = infer_body(4.0)
            scope = {
                "type": "http",
                "method": "POST",
                "path": "/v2/models/new/infer",
                "headers": [(b"host", b"test"), (b"content-length", b"%d" % len(payload))],
                "http_version": "1.1",
            }
            messages = [{"type": "http.request", "body": payload, "more_body": False}]
            sent: list[dict[str, Any]] = []
            never: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()

            async def receive() -> dict[str, Any]:
                return messages.pop(0) if messages else await never

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)

            # WHEN the first request names it through the ASGI entry point
            await asyncio.wait_for(GpuServiceApp(plane)(scope, receive, send), WAIT_S)
            # THEN it is served by the model
            assert sent[0]["status"] == 200
            assert json.loads(sent[1]["body"]) == answer_of("new", 5.0)

    asyncio.run(main())


class _Context:
    def peer(self) -> str:
        return "ipv4:127.0.0.1:40000"

    def invocation_metadata(self) -> tuple[()]:
        return ()


def test_grpc_first_request_for_a_newly_published_model_is_served(tmp_path: Path) -> None:
    async def main() -> None:
        async with started(tmp_path) as (repo, plane):
            repo.add("new", 1)
            message = service_pb2.ModelInferRequest(model_name="new")
            message.inputs.add(name="x", datatype="FP32", shape=[1, 1])
            message.raw_input_contents.append(np.array([[6.0]], np.float32).tobytes())

            async def one() -> AsyncIterator[Any]:
                yield message

            # WHEN the first request names it on the gRPC door
            service = InferenceService(plane)
            response = await asyncio.wait_for(service.ModelInfer(one(), _Context()), WAIT_S)
            # THEN it is served by the model
            assert (response.model_name, response.model_version) == ("new", "1")
            assert np.frombuffer(response.raw_output_contents[0], np.float32).tolist() == [7.0]

    asyncio.run(main())


def test_concurrent_first_requests_share_one_listing(tmp_path: Path) -> None:
    async def main() -> None:
        async with started(tmp_path) as (repo, plane):
            # GIVEN a newly published model and a listing that is held open
            repo.add("new", 1)
            repo.gate = threading.Event()
            listings = len(repo.began)
            # WHEN 20 first requests for it arrive
            requests = asyncio.gather(
                *(plane.infer("new", None, infer_body(float(i)), None) for i in range(20))
            )
            await asyncio.sleep(0)
            # THEN they share one listing, and each is served its own answer
            repo.gate.set()
            results = await asyncio.wait_for(requests, WAIT_S)
            assert [json.loads(r.body) for r in results] == [
                answer_of("new", i + 1.0) for i in range(20)
            ]
            assert len(repo.began) == listings + 1

    asyncio.run(main())


def test_invented_names_cost_at_most_one_listing_a_second(tmp_path: Path) -> None:
    async def main() -> None:
        async with started(tmp_path) as (repo, plane):
            registry = plane.registry
            known = set(registry.models)
            listings = len(repo.began)

            async def miss(name: str) -> str:
                with pytest.raises(ModelNotFoundError) as caught:
                    await plane.lookup(name)
                return caught.value.code

            # WHEN 50 requests name models that do not exist, at once
            codes = await asyncio.wait_for(
                asyncio.gather(*(miss(f"invented-{i}") for i in range(50))), WAIT_S
            )
            # THEN each is a 404 after one listing between them
            assert codes == ["model_not_found"] * 50
            assert len(repo.began) == listings + 1
            # AND 50 more, one after another, wait a listing each, a second apart at least
            for i in range(50, 100):
                assert await asyncio.wait_for(miss(f"invented-{i}"), WAIT_S) == "model_not_found"
            began = repo.began[listings:]
            assert len(began) == 51
            assert all(b - a >= MISS_LIST_S for a, b in itertools.pairwise(began))
            # AND nothing a request named is kept
            assert set(registry.models) == known

    asyncio.run(main())


def test_a_listing_that_hangs_or_fails_ends_in_404_not_a_hang(tmp_path: Path) -> None:
    async def main() -> None:
        async with started(tmp_path) as (repo, plane):
            repo.add("new", 1)
            # GIVEN a listing that hangs
            repo.gate = threading.Event()
            # WHEN a request with a short deadline names the new model
            with pytest.raises(ModelNotFoundError):
                await asyncio.wait_for(plane.lookup("new", timeout_s=0.01), WAIT_S)
            # THEN it is a 404 once its deadline is spent; when the listing ends, the
            # model is found
            repo.gate.set()
            await asyncio.wait_for(plane.lookup("new"), WAIT_S)
            assert "new" in plane.registry.models
            # AND a listing that fails is a 404 for a model it would have found
            repo.add("newer", 1)
            repo.failing = True
            with pytest.raises(ModelNotFoundError):
                await asyncio.wait_for(plane.lookup("newer"), WAIT_S)

    asyncio.run(main())


@pytest.mark.parametrize(
    ("path", "found"),
    [
        ("/v2/models/{m}", (200, "name", "new")),
        ("/v2/models/{m}/config", (200, "name", "new")),
        ("/v2/models/{m}/stats", (200, "model_stats", [])),
        ("/v2/models/{m}/ready", (400, "code", "not_ready")),
    ],
    ids=["metadata", "config", "stats", "ready"],
)
def test_http_metadata_routes_find_a_newly_published_model(
    tmp_path: Path, path: str, found: tuple[int, str, object]
) -> None:
    async def main() -> None:
        async with started(tmp_path) as (repo, plane):
            client = Harness(GpuServiceApp(plane)).connect()
            # GIVEN a model published after start (the last listing a while ago), and a
            # name nobody published
            repo.add("new", 1)
            repo.clock.now += MISS_LIST_S
            # WHEN a client asks about each before any infer request named it
            client.send(request("GET", path.format(m="new"), b""))
            client.send(request("GET", path.format(m="unpublished"), b""))
            await client.settle()
            # THEN the new model is found: about it (not ready, and no version's stats,
            # until its first request loads it, as for a model scaled to zero); the
            # other name is a 404
            (status, _, body), (missing, _, _) = client.answers()
            assert (status, json.loads(body)[found[1]]) == (found[0], found[2])
            assert missing == 404

    asyncio.run(main())


def test_grpc_metadata_rpcs_find_a_newly_published_model(tmp_path: Path) -> None:
    async def main() -> None:
        async with started(tmp_path) as (repo, plane):
            service = InferenceService(plane)
            context = _Context()
            # GIVEN models published after start (the last listing a while ago), one for
            # each RPC
            for name in ("a", "b", "c", "d"):
                repo.add(name, 1)
            repo.clock.now += MISS_LIST_S

            async def one(message: Any) -> AsyncIterator[Any]:
                yield message

            # WHEN each RPC names one before any infer request did
            ready = await service.ModelReady(one(service_pb2.ModelReadyRequest(name="a")), context)
            metadata = await service.ModelMetadata(
                one(service_pb2.ModelMetadataRequest(name="b")), context
            )
            config = await service.ModelConfig(
                one(service_pb2.ModelConfigRequest(name="c")), context
            )
            stats = await service.ModelStatistics(
                one(service_pb2.ModelStatisticsRequest(name="d")), context
            )
            # THEN each answers about its model (not ready until its first request)
            assert not ready.ready
            assert metadata.name == "b"
            assert config.config.name == "c"
            assert list(stats.model_stats) == []

    asyncio.run(main())


def test_metadata_misses_right_after_a_listing_are_404s_at_once(tmp_path: Path) -> None:
    async def main() -> None:
        async with started(tmp_path) as (repo, plane):
            client = Harness(GpuServiceApp(plane)).connect()
            # GIVEN a listing that began a moment ago (the registry's start), held open
            # from now on so that a request waiting for another would never be answered
            repo.gate = threading.Event()
            listings = len(repo.began)
            # WHEN a client asks about 20 names nobody published, one after another

            async def ask() -> None:
                for i in range(20):
                    client.send(request("GET", f"/v2/models/invented-{i}/ready", b""))
                    await client.settle()

            # THEN each is a 404 at once (waiting for a listing, each would take
            # MISS_WAIT_S: 40 s in all), and one listing began for all of them
            await asyncio.wait_for(ask(), WAIT_S)
            assert [status for status, _, _ in client.answers()] == [404] * 20
            assert len(repo.began) <= listings + 1

    asyncio.run(main())
