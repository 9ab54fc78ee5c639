"""``make demo``: the whole platform on 127.0.0.1, with real traffic through the router.

Scenarios, in order: digits on the GPU tier (accuracy), minilm similarity, a request the
policy sends to the CPU fallback, an offline batch job over S3, the GPU service killed
under load (nothing fails: the router falls back), a hot swap under load (nothing fails),
then a canary that fails on purpose, async requests and a pipeline, 50 concurrent frame
streams through the WebSocket API and gRPC streams, a summary per backend and a chart of
latency and routing over time.

Each section ends with its checks (``spillway_cli.console.Check``: a figure against its
bound). A failed check is printed at once with its name, figure and bound; the run ends
by listing the failed ones and exits 1. The canary section fails requests by design:
those failures are reported in that section and counted in no error total. No check
depends on how fast a loaded machine is: deadlines are generous, and the checks count
requests and compare versions and statuses.

The terminal gets the report only: every log line (the stack's, boto's, the batch job's)
goes to ``<out>/demo.log`` and each service's own log file; ``--verbose`` also shows the
log lines in the terminal.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import typer

from spillway.protocol.codec import decode_response, encode_request
from spillway.protocol.messages import JobStatus
from spillway.protocol.wire import parse_header_length
from spillway_cli.console import Check, CheckFailed, Checks, at_least, at_most, equal
from spillway_cli.demo_async import scenario_async
from spillway_cli.demo_canary import CanaryReport, scenario_canary
from spillway_cli.demo_pipelines import scenario_topics
from spillway_cli.frame_streams import Scenario, frame_sets
from spillway_cli.stack import DATA_BUCKET, REGION, LocalStack, offline_missing
from spillway_cli.stream_drivers import Endpoints, run_door

log = logging.getLogger("spillway.demo")

ACCURACY_BOUND = 0.9
"""The least accuracy the digits model may have on its held-out images (it has 0.97)."""
RECOVERY_LIMIT_S = 300.0
"""How long the router may take to go back to a restarted GPU service: more than the
breaker's longest wait (``ROUTER_BREAKER_MAX_RESET_S``, 120 s) plus a loaded start."""
ASYNC_LIMIT_S = 300.0
"""How long the async section's requests may take to finish."""
REQUEST_TIMEOUT_S = 300.0
"""How long a request may wait for its answer: a router instance started for it (a
Lambda cold start, a Python process importing the router) takes a minute on a loaded
2-core machine, and that is slow, not failed."""

SENTENCES = (
    "A cat sits on the mat.",
    "A kitten is resting on a rug.",
    "The stock market fell sharply today.",
    "Shares dropped steeply in early trading.",
    "How do I reset my password?",
)


@dataclass
class Record:
    """One request as the client saw it."""

    at: float
    scenario: str
    status: int
    backend: str
    latency_ms: float
    cost_usd: float
    fallback: str | None


@dataclass
class Client:
    """Sends V2 requests to the router and records what happened."""

    port: int
    headers: dict[str, str] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    records: list[Record] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    local: threading.local = field(default_factory=threading.local)

    def _conn(self) -> http.client.HTTPConnection:
        if getattr(self.local, "conn", None) is None:
            self.local.conn = http.client.HTTPConnection(
                "127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S
            )
        conn: http.client.HTTPConnection = self.local.conn
        return conn

    def _post(
        self, path: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, dict[str, str], bytes]:
        # A kept-alive connection the server closed while idle fails before any answer:
        # that one case is retried once on a new connection, as HTTP clients do.
        for attempt in (1, 2):
            reused = getattr(self.local, "conn", None) is not None
            try:
                conn = self._conn()
                conn.request("POST", path, body=body, headers=headers)
                response = conn.getresponse()
                raw = response.read()
                return response.status, {k.lower(): v for k, v in response.getheaders()}, raw
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as exc:
                self.local.conn = None
                if not reused or attempt == 2:
                    log.info("no answer from the router to %s: %r", path, exc)
                    break
            except (OSError, http.client.HTTPException) as exc:
                self.local.conn = None
                log.info("no answer from the router to %s: %r", path, exc)
                break
        return 599, {}, b""

    def infer(
        self,
        scenario: str,
        model: str,
        inputs: dict[str, np.ndarray],
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], Any]:
        body, length = encode_request(inputs, binary=True, binary_outputs=True)
        sent = {"Content-Type": "application/octet-stream", **self.headers, **(headers or {})}
        if length is not None:
            sent["Inference-Header-Content-Length"] = str(length)
        started = time.monotonic()
        status, got, raw = self._post(f"/v2/models/{model}/infer", body, sent)
        elapsed = (time.monotonic() - started) * 1e3
        self._record(scenario, status, got, elapsed)
        if status != 200:
            # The demo's own log file (the terminal shows the checks): what the router said.
            log.info("%s request answered %d: %s", scenario, status, raw[:300])
            return status, got, raw
        length_out = parse_header_length(got.get("inference-header-content-length"))
        return status, got, decode_response(raw, length_out)[1]

    def _record(self, scenario: str, status: int, headers: dict[str, str], ms: float) -> None:
        record = Record(
            time.monotonic() - self.started,
            scenario,
            status,
            headers.get("x-spillway-backend", "none"),
            ms,
            float(headers.get("x-spillway-cost-usd", 0.0)),
            headers.get("x-spillway-fallback"),
        )
        with self.lock:
            self.records.append(record)


def under_load(
    client: Client, scenario: str, count: int, threads: int, during: Callable[[], None]
) -> list[Record]:
    """``count`` digits requests from ``threads`` clients while ``during`` runs; the
    section's records (its warm-up requests, scenario ``warm-up``, apart).

    Every client's first request is answered before the load starts: a router that
    starts an instance for each concurrent request it cannot give to an idle one
    (serverless-offline, as Lambda does) has started them by then, so the section does
    not race their start-up (a Python process importing the router: up to a minute on a
    loaded 2-core machine). ``during`` runs once a quarter of the requests are answered:
    counted, not timed.
    """
    images = np.random.default_rng(3).random((count, 1, 8, 8)).astype(np.float32) * 16
    started = threading.Barrier(threads)
    before = len(client.records)

    def worker(offset: int) -> None:
        client.infer("warm-up", "digits", {"image": images[offset]})
        started.wait()
        for i in range(offset, count, threads):
            client.infer(scenario, "digits", {"image": images[i]})

    def answered() -> int:
        with client.lock:
            return sum(r.scenario == scenario for r in client.records[before:])

    with ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(worker, t) for t in range(threads)]
        while answered() < count // 4 and not all(f.done() for f in futures):
            time.sleep(0.01)
        during()
        for future in futures:
            future.result()
    return [r for r in client.records[before:] if r.scenario == scenario]


def say(text: str) -> None:
    typer.echo(text)


def failed(records: list[Record]) -> Check:
    """Every request of ``records`` answered 200; the figure names the failed statuses
    (599: no answer reached the client)."""
    statuses = Counter(r.status for r in records if r.status != 200)
    detail = ", ".join(f"{status} x{n}" for status, n in sorted(statuses.items()))
    count = sum(statuses.values())
    figure = f"{count} of {len(records)}" + (f" ({detail})" if detail else "")
    return Check("requests that failed", figure, f"= 0 of {len(records)}", count == 0)


def scenario_digits(client: Client, models: Path) -> list[Check]:
    images = np.load(models / "digits/samples/images.npy", allow_pickle=False).astype(np.float32)
    labels = np.load(models / "digits/samples/labels.npy", allow_pickle=False)
    correct = 0
    for start in range(0, len(images), 16):
        status, _, out = client.infer("digits", "digits", {"image": images[start : start + 16]})
        if status != 200:
            continue
        correct += int((out["label"][:, 0] == labels[start : start + 16]).sum())
    accuracy = correct / len(labels)
    backends = {r.backend for r in client.records if r.scenario == "digits"}
    say(
        f"1. digits via the router: accuracy {accuracy:.4f} on {len(labels)} held-out images "
        f"(served by: {', '.join(sorted(backends))})"
    )
    return [
        failed([r for r in client.records if r.scenario == "digits"]),
        at_least("accuracy on the held-out images", round(accuracy, 4), ACCURACY_BOUND),
    ]


def scenario_minilm(client: Client) -> list[Check]:
    texts = np.array([[s.encode()] for s in SENTENCES], dtype=np.object_)
    status, headers, out = client.infer("minilm", "minilm", {"text": texts})
    answered = [equal("the request was answered", status, 200, "(HTTP status)")]
    if status != 200:
        return answered
    emb = np.asarray(out["embedding"], dtype=np.float32)
    sims = emb @ emb.T
    say(f"\n2. minilm via the router ({headers.get('x-spillway-backend')}): cosine similarity")
    say("      " + "".join(f"     s{i}" for i in range(len(SENTENCES))))
    for i, row in enumerate(sims):
        say(f"  s{i}  " + "".join(f"{v:7.3f}" for v in row) + f"   {SENTENCES[i]}")
    # s0/s1 and s2/s3 are paraphrases: each is closer to its own than to the other pair.
    margin = min(sims[0, 1], sims[2, 3]) - max(sims[0, 2], sims[0, 3], sims[1, 2], sims[1, 3])
    return [
        *answered,
        at_least("paraphrases closer than unrelated sentences by", round(float(margin), 3), 0.1),
    ]


def scenario_serverless(client: Client) -> list[Check]:
    image = {"image": np.zeros((1, 8, 8), np.float32)}
    status, headers, _ = client.infer(
        "serverless", "digits", image, {"x-spillway-mode": "serverless", "x-spillway-priority": "3"}
    )
    say(
        f"\n3. a serverless, low-priority request: {status}, served by "
        f"{headers.get('x-spillway-backend')} (rule {headers.get('x-spillway-rule')}, "
        f"cost ${float(headers.get('x-spillway-cost-usd', 0)):.7f})"
    )
    return [
        equal("the request was answered", status, 200, "(HTTP status)"),
        equal("the CPU fallback served it", headers.get("x-spillway-backend"), "cpu"),
    ]


def scenario_batch(stack: LocalStack, models: Path, out: Path, checks: Checks) -> None:
    from spillway.aws.clients import aws_client

    images = np.load(models / "digits/samples/images.npy", allow_pickle=False)[:300]
    s3 = aws_client("s3", REGION)
    for shard in range(3):
        lines = [
            json.dumps({"id": f"img-{shard}-{i}", "data": {"image": img.tolist()}})
            for i, img in enumerate(images[shard * 100 : (shard + 1) * 100])
        ]
        s3.put_object(
            Bucket=DATA_BUCKET,
            Key=f"inputs/digits/part-{shard}.jsonl",
            Body="\n".join(lines).encode(),
        )
    say("\n4. an offline batch job over s3://spillway-data/inputs/digits/ (3 files, 300 records):")
    status = run_batch_job(stack, "digits", "inputs/digits/", "outputs/digits/", out / "jobs")
    say(
        f"   job {status.job_id[:8]} {status.state}: {status.shards_done}/{status.shards_total} "
        f"shards, {status.records} records, {status.errors} errors (logs: {out / 'jobs'})"
    )
    section = "4. batch job"
    checks.require(section, equal("the job's state", status.state, "SUCCEEDED"))
    listing = s3.list_objects_v2(Bucket=DATA_BUCKET, Prefix="outputs/digits/")
    keys = [o["Key"] for o in listing.get("Contents", [])]
    outputs = [k for k in keys if k.endswith(".jsonl") and not k.endswith(".errors.jsonl")]
    truth = np.load(models / "digits/samples/labels.npy", allow_pickle=False)[:300]
    correct = total = 0
    for key in outputs:
        for line in s3.get_object(Bucket=DATA_BUCKET, Key=key)["Body"].read().splitlines():
            record = json.loads(line)
            shard, index = (int(x) for x in record["id"].split("-")[1:])
            correct += int(np.ravel(record["outputs"]["label"])[0] == truth[shard * 100 + index])
            total += 1
    accuracy = correct / total if total else 0.0
    say(f"   {total} output records in {len(outputs)} files; accuracy {accuracy:.4f}")
    checks.record(
        section,
        [
            equal("records the job counted", status.records, 300),
            equal("records the job failed", status.errors, 0),
            equal("output records", total, 300),
            at_least("accuracy of the output records", round(accuracy, 4), ACCURACY_BOUND),
        ],
    )


def run_batch_job(
    stack: LocalStack, model: str, inputs: str, outputs: str, log_dir: Path
) -> JobStatus:
    """Submit a job as the operator does (``spillway jobs submit``: the operator tenant's,
    writing where it says), run its array children here (moto records Batch jobs but runs
    none) and show its shards as a progress bar until it ends."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from batch_job.service import JobService
    from batch_job.settings import JobsSettings
    from spillway.protocol.messages import JobRequest
    from spillway_cli.jobs_cli import LAUNCHER
    from spillway_cli.local_batch import run_local

    os.environ.update(stack.jobs_env())  # the children inherit it, as the jobs API's do
    settings = JobsSettings()
    service = JobService(settings)
    fields = {"model": model, "input": f"s3://{DATA_BUCKET}/{inputs}"}
    request = JobRequest.parse(json.dumps({**fields, "output": f"s3://{DATA_BUCKET}/{outputs}"}))
    job = service.submit_as_operator(request).job
    if job.batch_job_id is None:
        raise RuntimeError(f"job {job.job_id} reached no Batch queue")
    children = threading.Thread(
        target=run_local, args=(settings, job.batch_job_id, LAUNCHER, log_dir), daemon=True
    )
    children.start()
    columns = (TextColumn("   {task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns) as bar:
        task = bar.add_task(f"job {job.job_id[:8]}", total=job.shards_total)
        # Batch's own state is no guide here (moto settles a job it never ran): the job
        # is over when its children are, and its status then reads the shard markers.
        while True:
            ended = not children.is_alive()
            status = service.status_as_operator(job.job_id)
            bar.update(task, completed=status.shards_done)
            if ended:
                return status
            time.sleep(0.5)


def scenario_kill_gpu(client: Client, stack: LocalStack, checks: Checks) -> None:
    def kill() -> None:
        stack.children["gpu"].signal(9)

    records = under_load(client, "gpu-killed", 600, 8, kill)
    failures = sum(r.status != 200 for r in records)
    fallback = sum(r.fallback is not None or r.backend == "cpu" for r in records)
    say(
        f"\n5. GPU service SIGKILLed under load: {len(records)} requests, {failures} failed, "
        f"{fallback} answered by the CPU fallback"
    )
    section = "5. GPU service killed"
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


def scenario_hot_swap(client: Client, stack: LocalStack, models: Path) -> list[Check]:
    from spillway.models.repository import open_repository
    from spillway_cli.stack import REPOSITORY

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
    say(
        f"\n6. hot swap of digits under load: {len(records)} requests ({on_gpu} on the GPU "
        f"service), {failures} failed"
    )
    return [
        equal("the load call was answered", loaded[0] if loaded else None, 200, "(HTTP status)"),
        failed(records),
    ]


def scenario_frame_streams(stack: LocalStack, models: Path) -> list[Check]:
    """50 streams of 20 digits frames, 2 in flight a stream, then 20 streams of 2 OCR
    pages (rendered text, to the OCR detector), 1 in flight a stream, each through the
    WebSocket API (router) and through gRPC streams (GPU service): every frame answered
    once, in seq order, rightly: a digits frame with the label ONNX Runtime gives it, a
    page with a box for each of its lines where the detector's own code finds them.

    Two digits frames in flight a stream, not more: the local WebSocket API answers 10-20
    frames/s on a loaded 2-core machine (docs/benchmarks.md, "Frame streams"), so 400
    frames in flight would wait past API Gateway's 29 s integration timeout; 100 wait
    about 8 s. OCR pages are 20 streams: a page is about half a second of this machine's
    CPU, so 50 at once would wait about 25 s. A page travels in a text frame as base64
    (API Gateway closes the connection on a binary frame).

    The WebSocket API is ``spillway serve websocket`` under every router runtime (under
    serverless-offline too: its own WebSocket server started a Python process for every
    invocation that found none idle, and took binary frames API Gateway refuses)."""
    sets = frame_sets(models)
    made: list[Check] = []
    for frames in sets:
        scenario = (
            Scenario(streams=50, frames=20, window=2)
            if frames.model == "digits"
            else Scenario(streams=20, frames=2, window=1)
        )
        say(
            f"\n10. frame streams: {scenario.streams} streams x {scenario.frames} "
            f"{frames.what}, {scenario.window} in flight a stream"
        )
        for door in ("websocket", "grpc"):
            run = run_door(door, Endpoints.of_stack(stack), scenario, frames)
            say(f"   {run.line()}")
            made += run.checks()
    if len(sets) == 1:
        say("   (no OCR detector in this repository: no OCR pages)")
    return made


def summary(client: Client) -> str:
    """Requests per backend of sections 1 to 6 (the only ones the client records), with
    their latencies, errors (non-200 answers) and cost."""
    rows = [
        "| backend | requests | p50 ms | p99 ms | errors | cost USD |",
        "|---|---|---|---|---|---|",
    ]
    for backend in sorted({r.backend for r in client.records}):
        mine = [r for r in client.records if r.backend == backend]
        lat = np.array([r.latency_ms for r in mine])
        rows.append(
            f"| {backend} | {len(mine)} | {np.percentile(lat, 50):.1f} | "
            f"{np.percentile(lat, 99):.1f} | {sum(r.status != 200 for r in mine)} | "
            f"{sum(r.cost_usd for r in mine):.6f} |"
        )
    return "\n".join(rows)


def apart(canary: CanaryReport) -> str:
    """The by-design failures of the canary section, reported apart from the errors."""
    total = sum(canary.requests.values())
    return (
        f"Intentional failures, apart from the error totals: section 7's canary v{canary.canary} "
        f"fails 20 % of its inputs on purpose; it failed {canary.by_design_failures} of the "
        f"section's {total} requests before the router rolled it back. They are counted in "
        "no error total above, and the section's checks say what had to hold there."
    )


def chart(client: Client, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for backend in sorted({r.backend for r in client.records}):
        mine = [r for r in client.records if r.backend == backend]
        ax.scatter([r.at for r in mine], [r.latency_ms for r in mine], s=4, label=backend)
    for scenario in ("gpu-killed", "hot-swap"):
        times = [r.at for r in client.records if r.scenario == scenario]
        if times:
            ax.axvspan(min(times), max(times), alpha=0.1)
            ax.text(
                min(times),
                ax.get_ylim()[1] if ax.get_ylim()[1] else 1,
                scenario,
                fontsize=8,
                va="top",
            )
    ax.set_yscale("log")
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("latency (ms)")
    ax.set_title("Spillway demo: latency and routing over time")
    ax.legend(title="backend", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def _interrupted(signum: int, _: object) -> None:
    raise KeyboardInterrupt


def run_demo(
    models: Path, out: Path, router_runtime: str = "wsgi", router_fallback: bool = False
) -> None:
    """Bring the stack up, run every scenario through the router, stop everything; exit
    1 naming every failed check."""
    checks = Checks(say)
    say(f"Starting the platform on 127.0.0.1 (logs: {out / 'demo.log'}, {out / 'stack'}) ...")
    stack = LocalStack(
        models, out / "stack", router_runtime=router_runtime, router_fallback=router_fallback
    )
    signal.signal(signal.SIGTERM, _interrupted)  # the stack's processes stop with the demo
    try:
        stack.start()
        say("Spillway is up:\n" + stack.summary() + "\n")
        missing = offline_missing() if stack.router_runtime == "wsgi" else []
        why = f" (serverless-offline needs {', '.join(missing)})" if missing else ""
        if router_runtime != stack.router_runtime:
            why = f" (it did not come up under {router_runtime}: see {stack.log_dir}/router.log)"
        say(f"The router runs as {stack.router_runtime}{why}.")
        say(f"Live dashboard: {stack.url('dashboard')}/\n")
        client = Client(stack.ports.router, dict(stack.router_headers))
        _scenarios(stack, client, models, out, checks)
    except CheckFailed:
        pass  # printed as it was recorded; the verdict below names it again
    finally:
        stack.stop()
    say("\n" + checks.verdict())
    if checks.failed:
        raise typer.Exit(1)


def _scenarios(stack: LocalStack, client: Client, models: Path, out: Path, checks: Checks) -> None:
    """Every section, in order, each followed by its checks."""
    checks.record("1. digits", scenario_digits(client, models))
    checks.record("2. minilm", scenario_minilm(client))
    checks.record("3. serverless", scenario_serverless(client))
    scenario_batch(stack, models, out, checks)
    scenario_kill_gpu(client, stack, checks)
    checks.record("6. hot swap", scenario_hot_swap(client, stack, models))
    canary = scenario_canary(stack, models, say)
    checks.record("7. canary (fails on purpose)", canary.checks())
    asynchronous = scenario_async(
        stack.ports.router, dict(stack.router_headers), models, say, timeout_s=ASYNC_LIMIT_S
    )
    checks.record("8. async", asynchronous.checks())
    topics = scenario_topics(stack.ports.router, dict(stack.router_headers), say)
    checks.record("9. topics", topics.checks())
    checks.record("10. frame streams", scenario_frame_streams(stack, models))
    say("\nSummary per backend (sections 1-6):\n" + summary(client))
    checks.record("summary (sections 1-6)", [failed(client.records)])
    say(apart(canary))
    chart(client, out / "demo.png")
    say(f"\nChart: {out / 'demo.png'}")
