"""Overload and soak: a full GPU queue spills or answers 429, nothing is lost, memory and
queues stay bounded."""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from spillway_cli.demo.client import Client
from spillway_cli.local import procs
from spillway_cli.local.stack import LocalStack
from tests.support import Service, gpu_service, write_slow_model

POLICY = """version: 1
fallbacks: {{gpu: [cpu]}}
rules:
  - name: default
    route: gpu
    fallback: {fallback}
"""


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@dataclass
class Overload:
    """The processes of the overload tests."""

    gpu: Service
    falls_back_port: int
    no_fallback_port: int


def _router(tmp: Path, name: str, fallback: str, gpu: str, cpu: str) -> tuple[procs.Child, int]:
    policy = tmp / f"{name}.yaml"
    policy.write_text(POLICY.format(fallback=fallback))
    port = procs.free_port()
    argv = [
        sys.executable,
        "-m",
        "spillway_cli.main",
        "serve",
        "router",
        "--port",
        str(port),
        "--policy",
        str(policy),
        "--gpu-url",
        gpu,
        "--cpu-url",
        cpu,
    ]
    # A generous deadline: this test is about queue bounds, not about deadlines.
    child = procs.start(name, argv, tmp, {"ROUTER_DEFAULT_DEADLINE_MS": "60000"})
    procs.wait_http(f"http://127.0.0.1:{port}/v2/health/live", 60, child.proc)
    return child, port


@pytest.fixture(scope="module")
def overload(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Overload]:
    """A slow model with a queue of 4 on the GPU service, a CPU fallback, and two routers:
    one that falls back to the CPU, one with no fallback."""
    tmp = tmp_path_factory.mktemp("overload")
    repo, cpu_repo = tmp / "repo", tmp / "cpu-repo"
    write_slow_model(repo, max_batch_size=1, max_queue_size=4, steps=2)
    # The same model, without the slow part, for the CPU fallback to keep up.
    write_slow_model(cpu_repo, max_batch_size=1, max_queue_size=64, steps=0)
    with gpu_service(repo, tmp / "logs", instance_count="1") as gpu:
        cpu_port = procs.free_port()
        cpu = procs.start(
            "cpu",
            [
                sys.executable,
                "-m",
                "spillway_cli.main",
                "serve",
                "cpu",
                "--port",
                str(cpu_port),
                "--repository",
                str(repo),
            ],
            tmp,
        )
        procs.wait_http(f"http://127.0.0.1:{cpu_port}/v2/health/ready", 60, cpu.proc)
        cpu_url = f"http://127.0.0.1:{cpu_port}"
        falls_back, falls_back_port = _router(tmp, "falls-back", "[cpu]", gpu.base, cpu_url)
        no_fallback, no_fallback_port = _router(tmp, "no-fallback", "[]", gpu.base, cpu_url)
        try:
            yield Overload(gpu, falls_back_port, no_fallback_port)
        finally:
            for child in (falls_back, no_fallback, cpu):
                child.stop()


def burst(port: int, count: int) -> list[tuple[int, dict[str, str]]]:
    client = Client(port)
    values = np.arange(count, dtype=np.float32).reshape(count, 1, 1)

    def one(i: int) -> tuple[int, dict[str, str]]:
        status, headers, out = client.infer("burst", "slow", {"x": values[i]})
        if status == 200:  # each answer is its own
            assert float(out["y"][0, 0]) == float(i)
        return status, headers

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


def test_full_queue_without_fallback_answers_429_with_retry_after(overload: Overload) -> None:
    gpu = overload.gpu
    # GIVEN one burst served already: what its runs allocate once (each session's working
    # memory, a lone run's wide session included) is not growth
    burst(overload.no_fallback_port, 40)
    before = rss_bytes(gpu.child.pid)
    # WHEN 10x the queue bound arrives at once
    results = burst(overload.no_fallback_port, 40)
    statuses = Counter(status for status, _ in results)
    # THEN every request is answered: computed, or refused with 429 and a retry hint
    assert set(statuses) <= {200, 429}, statuses
    assert statuses[429] > 0
    assert statuses[200] >= 5  # one running plus the 4 queued
    for status, headers in results:
        if status == 429:
            assert int(headers["retry-after"]) >= 1
    # AND the GPU service's memory stayed bounded (the queue is bounded)
    assert rss_bytes(gpu.child.pid) - before < 64 * 1024 * 1024


def test_full_queue_with_fallback_is_served_by_the_cpu(overload: Overload) -> None:
    results = burst(overload.falls_back_port, 40)
    assert [s for s, _ in results if s != 200] == []
    fallbacks = [h.get("x-spillway-fallback", "") for _, h in results]
    assert any(f.startswith("gpu:") for f in fallbacks)
    assert Counter(h["x-spillway-backend"] for _, h in results)["cpu"] > 0


@pytest.mark.slow
def test_soak_mixed_load(stack: LocalStack) -> None:
    """Sustained mixed traffic for SPILLWAY_SOAK_S seconds (20 in CI): no errors besides
    intended 429s, no growth of queue depth or memory."""
    seconds = float(os.environ.get("SPILLWAY_SOAK_S", "20"))
    client = Client(stack.ports.router)
    gpu_pid = stack.children["gpu"].pid
    images = np.random.default_rng(5).random((64, 1, 8, 8)).astype(np.float32)
    texts = np.array([[b"sustained traffic for the soak test"]], dtype=np.object_)
    stop = time.monotonic() + seconds
    samples: list[int] = []

    def worker(index: int) -> None:
        i = 0
        while time.monotonic() < stop:
            if index % 4 == 3:
                client.infer("soak", "minilm", {"text": texts})
            elif index % 4 == 2:
                client.infer(
                    "soak", "digits", {"image": images[i % 64]}, {"x-spillway-mode": "serverless"}
                )
            else:
                client.infer("soak", "digits", {"image": images[i % 64]})
            i += 1

    def sampler() -> None:
        while time.monotonic() < stop:
            samples.append(rss_bytes(gpu_pid))
            time.sleep(1)

    with ThreadPoolExecutor(9) as pool:
        futures = [pool.submit(worker, i) for i in range(8)] + [pool.submit(sampler)]
        for future in futures:
            future.result()
    records = [r for r in client.records if r.scenario == "soak"]
    assert len(records) > 100
    assert Counter(r.status for r in records if r.status not in (200, 429)) == Counter()
    # memory: the second half of the run grows by less than 10 % over the first half
    half = len(samples) // 2
    assert max(samples[half:]) < 1.1 * max(samples[:half])
    queue = client.infer("soak-end", "digits", {"image": images[0]})[1]
    assert int(queue.get("x-spillway-queue-depth", "0")) <= 1
    print(
        json.dumps(
            {
                "soak_s": seconds,
                "requests": len(records),
                "statuses": dict(Counter(r.status for r in records)),
            }
        )
    )
