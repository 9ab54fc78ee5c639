"""Model lifecycle figures: cold start and footprint per model, and a hot swap under load.

    .venv/bin/python -m bench.lifecycle_bench

Writes ``docs/bench-lifecycle.md``.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from spillway.models.repository import LocalRepository
from spillway.protocol.codec import encode_request
from spillway_cli.local import procs

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("digits", "minilm", "mlp-bench")


def body(model: str) -> bytes:
    import numpy as np

    samples: dict[str, dict[str, np.ndarray]] = {
        "digits": {"image": np.zeros((1, 8, 8), np.float32)},
        "minilm": {"text": np.array([[b"a short sentence to embed"]], dtype=np.object_)},
        "mlp-bench": {"input": np.zeros((1, 1024), np.float32)},
    }
    return encode_request(samples[model], binary=False)[0]


def call(port: int, method: str, path: str, data: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request(method, path, body=data)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def metric(port: int, name: str, label: str) -> float:
    text = call(port, "GET", "/metrics")[2].decode()
    return next(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(f"{name}{{{label}")
    )


def start(repo: Path, logs: Path, **settings: str) -> tuple[procs.Child, int]:
    port = procs.free_port()
    env = {
        "GPU_REPOSITORY": str(repo),
        "GPU_PORT": str(port),
        "GPU_LOG_LEVEL": "WARNING",
        "GPU_PROVIDERS": '["CPUExecutionProvider"]',
        **{f"GPU_{k.upper()}": v for k, v in settings.items()},
    }
    child = procs.start(f"gpu-{port}", [sys.executable, "-m", "gpu_service"], logs, env)
    procs.wait_http(f"http://127.0.0.1:{port}/v2/health/live", 120, child.proc)
    return child, port


def cold_starts(repo: Path, logs: Path) -> list[str]:
    child, port = start(repo, logs, model_control_mode="explicit", startup_models="[]")
    rows = [
        "| model | first request (ms) | load reported (ms) | footprint (MB) | method |",
        "|---|---|---|---|---|",
    ]
    try:
        for model in MODELS:
            started = time.perf_counter()
            status, headers, _ = call(port, "POST", f"/v2/models/{model}/infer", body(model))
            elapsed = (time.perf_counter() - started) * 1e3
            assert status == 200
            footprint = metric(port, "spillway_model_memory_bytes", f'model="{model}"') / 1e6
            rows.append(
                f"| {model} | {elapsed:.0f} | {headers['x-spillway-cold-start-ms']} | "
                f"{footprint:.1f} | RSS growth (CPU) |"
            )
    finally:
        child.stop()
    return rows


def hot_swap(repo: Path, logs: Path, models: Path) -> list[str]:
    child, port = start(repo, logs, model_control_mode="explicit")
    stop = threading.Event()
    results: list[tuple[int, str, float]] = []
    lock = threading.Lock()
    in_flight = [0]
    data = body("minilm")

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        while not stop.is_set():
            with lock:
                in_flight[0] += 1
            conn.request("POST", "/v2/models/minilm/infer", body=data)
            r = conn.getresponse()
            payload = r.read()
            with lock:
                in_flight[0] -= 1
                version = json.loads(payload).get("model_version", "-")
                results.append((r.status, version, time.perf_counter()))
        conn.close()

    try:
        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(client) for _ in range(16)]
            time.sleep(2)
            LocalRepository(repo).publish_version(
                "minilm",
                {
                    "model.onnx": models / "minilm/1/model.onnx",
                    "tokenizer.json": models / "minilm/1/tokenizer.json",
                },
            )
            swap_started = time.perf_counter()
            with lock:
                at_swap = in_flight[0]
            status, _, _ = call(port, "POST", "/v2/repository/models/minilm/load")
            swap_s = time.perf_counter() - swap_started
            time.sleep(2)
            stop.set()
            for f in futures:
                f.result()
    finally:
        child.stop()
    failures = sum(1 for s, _, _ in results if s != 200)
    first_new = min(t for s, v, t in results if v == "2")
    last_old = max(t for s, v, t in results if v == "1")
    return [
        "| measure | value |",
        "|---|---|",
        f"| requests during the run (16 clients, minilm) | {len(results)} |",
        f"| requests in flight when the load call began | {at_swap} |",
        f"| load call (download, verify, load, warm, switch, drain) | {swap_s * 1e3:.0f} ms |",
        f"| answered by v1 / v2 | {sum(v == '1' for _, v, _ in results)} / "
        f"{sum(v == '2' for _, v, _ in results)} |",
        f"| clean switch (no v1 answer after the first v2 answer) | {last_old <= first_new} |",
        f"| failed requests | {failures} |",
        f"| load call status | {status} |",
    ]


def main() -> None:
    models = Path(os.environ.get("SPILLWAY_MODELS_DIR", ROOT / "models"))
    work = Path(tempfile.mkdtemp(prefix="spillway-lifecycle-"))
    repo = work / "repo"
    repo.mkdir()
    for model in MODELS:
        shutil.copytree(models / model, repo / model, copy_function=os.link)
    try:
        cold = cold_starts(repo, work / "logs")
        swap = hot_swap(repo, work / "logs", models)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = (
        f"Run {stamp}, CPU provider, {os.cpu_count()} CPUs.\n\nCold start per model "
        f"(explicit mode, nothing loaded at start):\n\n"
        + "\n".join(cold)
        + "\n\nHot swap of minilm v1 → v2 under continuous load:\n\n"
        + "\n".join(swap)
        + "\n"
    )
    (ROOT / "docs" / "bench-lifecycle.md").write_text(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
