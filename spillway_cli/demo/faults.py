"""The demo's fault sections, each under load from the recording client: the GPU
service SIGKILLed (nothing fails: the router falls back to the CPU, then goes back to
the restarted service once its breaker closes) and a new version of a model hot-swapped
(nothing fails)."""

from __future__ import annotations

import http.client
import time
from pathlib import Path

import numpy as np

from spillway_cli.console import Check, Checks, at_most, equal
from spillway_cli.demo.client import Client, failed, under_load
from spillway_cli.demo.report import say
from spillway_cli.local.stack import LocalStack

RECOVERY_LIMIT_S = 300.0
"""How long the router may take to go back to a restarted GPU service: more than the
breaker's longest wait (``ROUTER_BREAKER_MAX_RESET_S``, 120 s) plus a loaded start."""


def scenario_kill_gpu(
    client: Client, stack: LocalStack, checks: Checks, section: str
) -> list[Check]:
    """SIGKILL the GPU service under load, restart it; the router must go back to it for
    the rest of the demo to run (``section``: the name its checks are recorded under)."""

    def kill() -> None:
        stack.children["gpu"].signal(9)

    records = under_load(client, "gpu-killed", 600, 8, kill)
    failures = sum(r.status != 200 for r in records)
    fallback = sum(r.fallback is not None or r.backend == "cpu" for r in records)
    say(f"   {len(records)} requests, {failures} failed, {fallback} answered by the CPU fallback")
    checks.record(section, [failed(records)])
    stack.children.pop("gpu").proc.wait(10)
    stack.start_gpu()
    # The router's circuit breaker reopens the GPU route after its half-open probe succeeds.
    started = time.monotonic()
    back_after: float | None = None
    image = {"image": np.zeros((1, 8, 8), np.float32)}
    while time.monotonic() - started < RECOVERY_LIMIT_S:
        if client.infer("recovery", "digits", image)[1].get("x-spillway-backend") == "gpu":
            back_after = round(time.monotonic() - started, 1)
            break
        time.sleep(0.5)
    back = at_most(
        "the router went back to the GPU service after", back_after, RECOVERY_LIMIT_S, "s"
    )
    checks.require(section, back)
    say(f"   GPU service restarted; the router's breaker closed again ({back.figure} later)")
    return []


def scenario_hot_swap(client: Client, stack: LocalStack, models: Path) -> list[Check]:
    from spillway.models.repository import open_repository
    from spillway_cli.local.names import REPOSITORY

    loaded: list[int] = []

    def swap() -> None:
        version = open_repository(REPOSITORY).publish_version(
            "digits", {"model.onnx": models / "digits/1/model.onnx"}
        )
        conn = http.client.HTTPConnection("127.0.0.1", stack.ports.gpu, timeout=120)
        conn.request("POST", "/v2/repository/models/digits/load")
        response = conn.getresponse()
        response.read()
        loaded.append(response.status)
        say(f"   published digits v{version}; load call answered {response.status}")

    records = under_load(client, "hot-swap", 1500, 8, swap)
    failures = sum(r.status != 200 for r in records)
    on_gpu = sum(r.backend == "gpu" for r in records)
    say(f"   {len(records)} requests ({on_gpu} on the GPU service), {failures} failed")
    return [
        equal("the load call was answered", loaded[0] if loaded else None, 200, "(HTTP status)"),
        failed(records),
    ]
