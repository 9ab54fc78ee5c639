"""The preparation queue with a fake text model: requests that arrive together are
prepared in one call, each gets its own outcome, and a bad request fails alone.

The "worker thread" is a coroutine the test holds open or lets finish, on a virtual-time
loop: no thread runs and nothing waits on real time."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import pytest

from gpu_service.preparing import PrepareQueue
from spillway import inference
from spillway.models.config import ModelConfig, TensorConfig
from spillway.models.engine import OnnxModel
from spillway.models.processing import Prepared, Tensors
from spillway.protocol.errors import InvalidInputError, SpillwayError
from tests.fakes import idle, run_virtual


@dataclass
class FakeTextModel:
    """Prepares texts by length; an empty text is the client's error. Records each call."""

    name: str = "fake-text"
    output_names: list[str] = field(default_factory=lambda: ["y"])
    config: ModelConfig = field(
        default_factory=lambda: ModelConfig(
            name="fake-text",
            input=(TensorConfig(name="text", data_type="TYPE_STRING", dims=(1,)),),
            output=(TensorConfig(name="y", data_type="TYPE_FP32", dims=(1,)),),
        )
    )
    calls: list[list[str]] = field(default_factory=list)

    def prepare_many(self, requests: Sequence[Tensors]) -> list[Prepared | SpillwayError]:
        texts = [r["text"].reshape(-1)[0].decode() for r in requests]
        self.calls.append(texts)
        return [
            Prepared({"len": np.array([[len(t)]])}, 1, len(t))
            if t
            else InvalidInputError("text must not be empty")
            for t in texts
        ]


def decoded(text: str) -> inference.Decoded:
    body = {"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": [text]}]}
    return inference.decode(json.dumps(body).encode(), None)


class HeldWorker:
    """An ``offload`` whose calls finish only when the test releases them."""

    def __init__(self) -> None:
        self.gates: list[asyncio.Event] = []

    async def __call__(self, function: Callable[..., Any], *args: Any) -> Any:
        gate = asyncio.Event()
        self.gates.append(gate)
        await gate.wait()
        return function(*args)

    def release(self) -> None:
        for gate in self.gates:
            gate.set()


def test_requests_that_arrive_together_are_prepared_in_one_call() -> None:
    model = FakeTextModel()
    outcomes: list[object] = []

    async def main() -> None:
        queue = PrepareQueue(cast(OnnxModel, model))
        worker = HeldWorker()
        # GIVEN three requests read in the same loop turn, one of them with an empty text
        tasks = [asyncio.ensure_future(queue.admit(decoded(t), worker)) for t in ("ab", "", "abcd")]
        await idle()
        worker.release()
        # WHEN the worker call finishes
        outcomes.extend(await asyncio.gather(*tasks, return_exceptions=True))

    run_virtual(main)
    # THEN one call prepared all three; each request got its own outcome
    assert model.calls == [["ab", "", "abcd"]]
    first, bad, third = outcomes
    assert isinstance(first, inference.Admitted)
    assert first.prepared.length == 2
    assert isinstance(bad, InvalidInputError)
    assert isinstance(third, inference.Admitted)
    assert third.prepared.length == 4
    assert first.outputs == ["y"]


def test_arrivals_during_a_call_go_together_in_the_next_one() -> None:
    model = FakeTextModel()
    lengths: list[int] = []

    async def main() -> None:
        queue = PrepareQueue(cast(OnnxModel, model), limit=2)
        worker = HeldWorker()
        first = asyncio.ensure_future(queue.admit(decoded("a"), worker))
        await idle()
        # GIVEN a call in progress, WHEN three more requests arrive meanwhile
        later = [asyncio.ensure_future(queue.admit(decoded(t), worker)) for t in ("bb", "ccc", "d")]
        await idle()
        assert model.calls == []
        while not all(t.done() for t in [first, *later]):
            worker.release()
            await idle()
        for task in [first, *later]:
            lengths.append(task.result().prepared.length)

    run_virtual(main)
    # THEN they wait for it and then go in calls of at most ``limit``, in arrival order
    assert model.calls == [["a"], ["bb", "ccc"], ["d"]]
    assert lengths == [1, 2, 3, 1]


def test_a_failed_call_fails_its_requests_and_the_queue_goes_on() -> None:
    model = FakeTextModel()

    async def broken(function: Callable[..., Any], *args: Any) -> Any:
        raise RuntimeError("worker died")

    async def fine(function: Callable[..., Any], *args: Any) -> Any:
        return function(*args)

    async def main() -> None:
        queue = PrepareQueue(cast(OnnxModel, model))
        # GIVEN a worker call that fails as a whole
        with pytest.raises(RuntimeError, match="worker died"):
            await queue.admit(decoded("a"), broken)
        # WHEN the next request comes THEN it is prepared as usual
        admitted = await queue.admit(decoded("xyz"), fine)
        assert admitted.prepared.length == 3

    run_virtual(main)
    assert model.calls == [["xyz"]]
