"""Adversarial requests over real HTTP against every service that takes them.

GIVEN the GPU service (its own process), the CPU fallback, the router in front of both,
and the jobs API (on moto), each on 127.0.0.1 — WHEN thousands of generated hostile
requests arrive on keep-alive connections (see ``tests/e2e/adversarial.py``) — THEN every
one is answered, within a timeout, with a 2xx or a 4xx whose body is
``{"error": str, "code": str}``; never a 5xx, a hang or a crash; and afterwards a valid
request still gets the right answer.

The cases come from seeded generators (``tests/e2e/gen.py``, Hypothesis-shaped but ~50×
faster to draw): the same ones on every run; a failure names its case index, and
``strategy.example(gen.seed(label, index))`` rebuilds the request.

The slow-client family: GIVEN a GPU service with short time limits — WHEN hundreds of
connections stall it (heads dripped a byte at a time, bodies that stop, ``Expect:
100-continue`` then silence, pipelined requests whose big answers are never read) —
THEN the service closes every one within seconds, computes little for the clients that
read nothing, and a well-behaved client gets 200 for every request meanwhile.

The gRPC family: GIVEN the GPU service's gRPC door — WHEN one tenant sends malformed
messages and holds more streams than its peer may — THEN it is refused with stable codes
and its idle streams end, while another tenant is answered every time. The WebSocket
family is ``test_adversarial_websocket.py`` (on the local stack).
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batch_job.api import dispatch
from batch_job.service import JobService
from spillway.fallback.app import CpuApp
from spillway.fallback.service import CpuService
from spillway.fallback.settings import CpuSettings
from spillway.protocol.codec import encode_request
from spillway.router.settings import RouterSettings
from spillway.router.wiring import create_app
from spillway.tenancy.identity import Authenticator
from spillway_cli.local.lambda_http import wsgi_app
from spillway_cli.local.wsgi_server import running
from tests.conftest import AWS_REGION
from tests.e2e import gen as st
from tests.e2e.adversarial import (
    Answer,
    Attack,
    Client,
    Request,
    Steady,
    check_answer,
    inference_requests,
    job_requests,
    junk,
    to_json,
)
from tests.integration.test_jobs_support import jobs_settings, new_bucket
from tests.support import Service, gpu_service, link_model, load_engine

CASES = int(os.environ.get("SPILLWAY_ADVERSARIAL_CASES", "5000"))
"""Generated cases per service (a smaller number for a quick local run)."""
MODELS = ["digits"]
INPUTS = ["image"]
CPU_FUNCTION = "spillway-cpu-infer"


def hammer(
    base: str,
    strategy: st.Gen[Request],
    label: str,
    cases: int = CASES,
    check: Callable[[Request, Answer], None] = check_answer,
) -> Counter[int]:
    """Send ``cases`` generated requests to ``base`` on one keep-alive connection (reopened
    when the server closes it); every answer must pass ``check``. Returns the answers
    counted by status, printed with the case count and the time taken."""
    client = Client(base)
    statuses: Counter[int] = Counter()
    started = time.monotonic()
    try:
        for index in range(cases):
            request = strategy.example(st.seed(label, index))
            answer = client.send(request)
            statuses[answer.status] += 1
            try:
                check(request, answer)
            except (AssertionError, ValueError, KeyError) as exc:
                raise AssertionError(f"{label} case {index}: {exc}") from exc
    finally:
        client.close()
    elapsed = time.monotonic() - started
    print(
        f"{label}: {sum(statuses.values())} cases in {elapsed:.1f} s, "
        f"{client.reconnects} connections, statuses {dict(sorted(statuses.items()))}"
    )
    return statuses


def _digits_request(images: np.ndarray) -> Request:
    body = {
        "inputs": [
            {
                "name": "image",
                "shape": list(images.shape),
                "datatype": "FP32",
                "data": images.ravel().tolist(),
            }
        ]
    }
    return Request("POST", "/v2/models/digits/infer", {}, json.dumps(body).encode())


def assert_still_serves(base: str, models_dir: Path) -> None:
    """A valid digits request gets the engine's labels (the service did not wedge)."""
    images = np.load(models_dir / "digits" / "samples" / "images.npy")[:8].astype(np.float32)
    expected = load_engine(models_dir, "digits").infer({"image": images})["label"]
    client = Client(base)
    try:
        answer = client.send(_digits_request(images))
    finally:
        client.close()
    assert answer.status == 200, answer.body[:300]
    outputs = {o["name"]: o for o in json.loads(answer.body)["outputs"]}
    assert outputs["label"]["data"] == expected.ravel().tolist()


def _assert_mostly_refused(statuses: Counter[int]) -> None:
    # The generator must reach both sides: some cases served, most refused as the client's.
    assert sum(statuses.values()) >= CASES
    assert statuses[200] > 0
    assert sum(n for s, n in statuses.items() if 400 <= s < 500) > CASES // 2


# --- services -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def repo(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adversarial-models")
    for name in MODELS:
        link_model(models_dir, root, name)
    return root


@pytest.fixture(scope="module")
def gpu(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with gpu_service(repo, tmp_path_factory.mktemp("gpu-logs"), parse_processes="1") as service:
        yield service


@pytest.fixture(scope="module")
def cpu_url(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    settings = CpuSettings(
        repository=str(repo),
        cache_dir=tmp_path_factory.mktemp("cpu-cache"),
        intra_op_threads=1,
        function_name=CPU_FUNCTION,
    )
    with running(CpuApp(CpuService.load(settings))) as url:
        yield url


@pytest.fixture(scope="module")
def aws(moto_endpoint: str) -> Iterator[str]:
    """boto3 pointed at the moto server for this module (as ``aws_env`` does per test)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
        patch.setenv("AWS_ACCESS_KEY_ID", "testing")
        patch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        patch.setenv("AWS_DEFAULT_REGION", AWS_REGION)
        patch.delenv("AWS_PROFILE", raising=False)
        yield moto_endpoint


@pytest.fixture(scope="module")
def jobs_url(aws: str, models_dir: Path) -> Iterator[str]:
    """The jobs Lambda behind a local HTTP server, as API Gateway would call it."""
    jobs = JobService(jobs_settings(aws, models_dir))
    # Hostile requests carry no credentials: trusted hints let them reach validation.
    callers = Authenticator(trust_tenant_hints=True)
    with running(wsgi_app(lambda event, context: dispatch(event, jobs, callers))) as url:
        yield url


@pytest.fixture(scope="module")
def router_url(gpu: Service, cpu_url: str, jobs_url: str) -> Iterator[str]:
    """The router over all three backends, batch mode included, as the local stack has it."""
    settings = RouterSettings(
        gpu_url=gpu.base,
        cpu_url=cpu_url,
        jobs_url=f"{jobs_url}/v1/jobs",
        jobs_staging=f"s3://{new_bucket()}/staging/",
        metrics_log=Path("/dev/null"),
    )
    with running(create_app(settings)) as url:
        yield url


# --- tests ----------------------------------------------------------------------------


def test_gpu_service_answers_every_adversarial_request(gpu: Service, models_dir: Path) -> None:
    strategy = inference_requests(MODELS, INPUTS, ["/v2/repository/models/digits/unload"])
    statuses = hammer(gpu.base, strategy, "gpu")
    _assert_mostly_refused(statuses)
    assert gpu.child.proc.poll() is None
    assert_still_serves(gpu.base, models_dir)


@st.composite
def _invoke_requests(draw: st.Draw) -> Request:
    """Lambda's invoke API on the CPU fallback, with generated direct-invoke events."""
    inner = draw(inference_requests(MODELS, INPUTS, []))
    event: dict[Any, Any] = {
        "operation": draw(st.sampled_from(["infer", "metadata", "ready", "config", "x"]) | junk),
        "model": inner.path.split("/")[3] if inner.path.count("/") >= 3 else draw(junk),
    }
    length = inner.headers.get("Inference-Header-Content-Length")
    if length is not None:
        event["headers"] = {"inference-header-content-length": length}
    how = draw(st.integers(0, 3))
    if how == 0:
        event["body"] = inner.body.decode("utf-8", "replace")
    elif how == 1:
        event["body_b64"] = base64.b64encode(inner.body).decode()
    elif how == 2:
        event["body_b64"] = draw(st.text(max_size=20))
    if draw(st.integers(0, 3)) == 0:
        event["version"] = draw(st.sampled_from(["1", "0", "-1", "1234567890"]) | junk)
    raw = to_json(event if draw(st.integers(0, 9)) else draw(junk)).encode("utf-8", "surrogatepass")
    name = CPU_FUNCTION if draw(st.integers(0, 9)) else draw(st.sampled_from(["x", "%2e%2e"]))
    return Request("POST", f"/2015-03-31/functions/{name}/invocations", {}, raw)


def _check_invoke(request: Request, answer: Answer) -> None:
    """A 200 from the invoke API carries the function's answer: that must pass too."""
    if answer.status == 404 and answer.headers.get("x-amzn-errortype"):
        return  # Lambda's own shape for an unknown function, as the real API answers
    check_answer(request, answer)
    if answer.status == 200:
        inner = json.loads(answer.body)
        body = inner["body"].encode()
        if inner.get("isBase64Encoded"):
            body = base64.b64decode(body)
        headers = {k.lower(): v for k, v in inner["headers"].items()}
        check_answer(request, Answer(inner["statusCode"], headers, body))


def test_cpu_fallback_answers_every_adversarial_request(cpu_url: str, models_dir: Path) -> None:
    statuses = hammer(cpu_url, inference_requests(MODELS, INPUTS, []), "cpu")
    _assert_mostly_refused(statuses)

    invoked = hammer(cpu_url, _invoke_requests(), "cpu-invoke", CASES // 5, _check_invoke)
    assert invoked[200] > CASES // 20
    assert_still_serves(cpu_url, models_dir)


def test_router_answers_every_adversarial_request(
    router_url: str, gpu: Service, models_dir: Path
) -> None:
    statuses = hammer(router_url, inference_requests(MODELS, INPUTS, []), "router")
    _assert_mostly_refused(statuses)
    assert gpu.child.proc.poll() is None
    assert_still_serves(router_url, models_dir)


def test_jobs_api_answers_every_adversarial_request(jobs_url: str) -> None:
    statuses = hammer(jobs_url, job_requests(), "jobs")
    assert sum(statuses.values()) >= CASES
    assert sum(n for s, n in statuses.items() if 400 <= s < 500) > CASES // 2
    # Still serving: a status request for a job that does not exist is a clean 404.
    client = Client(jobs_url)
    answer = client.send(Request("GET", "/v1/jobs/00000000-0000-4000-8000-000000000000"))
    client.close()
    assert answer.status == 404
    assert json.loads(answer.body)["code"] == "job_not_found"


# --- slow clients -----------------------------------------------------------------------

STRICT: dict[str, Any] = {
    "header_timeout_s": "1",
    "body_timeout_s": "1",
    "write_timeout_s": "2",
    "keep_alive_s": "3",
    "parse_processes": "1",
}
"""Short time limits, so every slow client is cut within seconds."""
CUT_WITHIN_S = 20.0
"""The longest a slow client may hold its connection: its limit and the once-a-second
sweep, with room for a busy machine computing the big answers first."""
NEVER_READING = 10
PIPELINED = 32
BIG_ROWS = 64


@pytest.fixture(scope="module")
def strict_gpu(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    root = tmp_path_factory.mktemp("slow-client-models")
    for name in ("digits", "mlp-bench"):
        link_model(models_dir, root, name)
    with gpu_service(root, tmp_path_factory.mktemp("strict-gpu-logs"), **STRICT) as service:
        yield service


def _big_answer_request() -> bytes:
    """An mlp-bench request whose JSON answer is about 1.3 MB."""
    rows = np.random.default_rng(0).random((BIG_ROWS, 1024), dtype=np.float32)
    body, length = encode_request({"input": rows}, binary=True, binary_outputs=False)
    head = (
        "POST /v2/models/mlp-bench/infer HTTP/1.1\r\nHost: x\r\n"
        f"Content-Length: {len(body)}\r\nInference-Header-Content-Length: {length}\r\n\r\n"
    )
    return head.encode() + body


def _rows_computed(base: str, model: str) -> int:
    client = Client(base)
    try:
        answer = client.send(Request("GET", f"/v2/models/{model}/stats"))
    finally:
        client.close()
    return int(json.loads(answer.body)["model_stats"][0]["inference_count"])


@pytest.mark.parametrize(
    "family", ["slow-heads", "stalled-bodies", "silent-continues", "never-reading"]
)
def test_gpu_service_cuts_slow_clients_while_serving_others(
    strict_gpu: Service, models_dir: Path, family: str
) -> None:
    images = np.load(models_dir / "digits" / "samples" / "images.npy")[:1].astype(np.float32)
    infer = "/v2/models/digits/infer"
    rows_before = _rows_computed(strict_gpu.base, "mlp-bench")
    attack = Attack(strict_gpu.port)
    # GIVEN a client that keeps sending valid requests
    with Steady(strict_gpu.base, _digits_request(images)) as steady:
        try:
            # WHEN slow clients open connections and stall them
            if family == "slow-heads":
                attack.slow_heads(200)
            elif family == "stalled-bodies":
                attack.stalled_bodies(100, infer)
            elif family == "silent-continues":
                attack.silent_continues(100, infer)
            else:
                attack.never_reading(NEVER_READING, _big_answer_request(), PIPELINED)
            # THEN the service closes every one of them
            closed = attack.wait_closed(CUT_WITHIN_S)
        finally:
            attack.close()
    # AND the steady client got 200 for every request meanwhile
    assert steady.error is None, steady.error
    assert steady.statuses
    assert set(steady.statuses) == {200}
    computed = (_rows_computed(strict_gpu.base, "mlp-bench") - rows_before) // BIG_ROWS
    print(
        json.dumps(
            {
                family: {
                    "connections_cut": len(closed),
                    "last_cut_s": round(max(closed), 1),
                    "steady_200s": len(steady.statuses),
                    "big_answers_computed": computed,
                }
            }
        )
    )
    # AND for clients that read nothing, little was computed (a few answers each, not 32)
    assert computed <= NEVER_READING * PIPELINED // 2
    assert strict_gpu.child.proc.poll() is None
    assert_still_serves(strict_gpu.base, models_dir)


# --- gRPC -------------------------------------------------------------------------------

GRPC_LIMITS: dict[str, Any] = {
    "grpc_max_rpcs_per_peer": "50",
    "grpc_stream_idle_s": "2",
    "write_timeout_s": "2",
}
"""Small gRPC limits, so the acme peer's attacks end within seconds."""


def test_grpc_door_cuts_one_peers_attacks_while_another_is_served(
    models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    import asyncio

    import grpc
    from tritonclient.grpc import service_pb2_grpc

    from spillway_cli.local import procs
    from tests.integration.test_grpc_limits import (
        INFER,
        Forwarder,
        channel,
        digits_request,
        spillway_code,
    )

    root = tmp_path_factory.mktemp("grpc-adversarial-models")
    link_model(models_dir, root, "digits")
    port = procs.free_port()
    logs = tmp_path_factory.mktemp("grpc-adversarial-logs")
    with gpu_service(root, logs, grpc_port=str(port), **GRPC_LIMITS) as service:
        forwarder = Forwarder(port)
        acme_address = forwarder.address_from("127.0.0.2")

        async def attack_and_serve() -> tuple[Counter[str], Counter[str], list[str]]:
            acme = [channel(acme_address, i) for i in range(2)]
            globex = channel(f"127.0.0.1:{port}", 99)
            # GIVEN acme (one peer) sending garbage as ModelInfer
            raw = acme[0].unary_unary(INFER, request_serializer=bytes, response_deserializer=bytes)
            garbage: Counter[str] = Counter()
            for payload in (b"\x00\xff", b"\x0a\xff\xff\xff", b"garbage" * 100):
                try:
                    await raw(payload, timeout=10)
                except grpc.aio.AioRpcError as error:
                    garbage[f"{error.code().name} {spillway_code(error)}"] += 1
            # AND acme opening 150 silent streams
            streams = [
                service_pb2_grpc.GRPCInferenceServiceStub(acme[i % 2]).ModelStreamInfer()
                for i in range(150)
            ]
            # WHEN globex calls ModelInfer meanwhile, ten times
            stub = service_pb2_grpc.GRPCInferenceServiceStub(globex)
            served = [
                (await stub.ModelInfer(digits_request(models_dir), timeout=20)).model_name
                for _ in range(10)
            ]
            # THEN every acme stream ends: refused past its slots, or at its idle limit
            ended: Counter[str] = Counter()
            for call in streams:
                try:
                    async for _ in call:
                        pass
                except grpc.aio.AioRpcError as error:
                    ended[f"{error.code().name} {spillway_code(error)}"] += 1
            for ch in (*acme, globex):
                await ch.close()
            return garbage, ended, served

        try:
            garbage, ended, served = asyncio.run(asyncio.wait_for(attack_and_serve(), 90))
        finally:
            forwarder.close()
        assert service.child.proc.poll() is None
    print(json.dumps({"grpc": {"garbage": garbage, "streams": ended, "globex": len(served)}}))
    assert garbage == Counter({"INVALID_ARGUMENT malformed_message": 3})
    assert ended == Counter(
        {"RESOURCE_EXHAUSTED too_many_rpcs": 100, "DEADLINE_EXCEEDED idle_timeout": 50}
    )
    # AND globex was answered every time
    assert served == ["digits"] * 10
