"""The step cache never crosses tenants, on every runtime that runs pipelines.

Two real tenants: API Gateway events carrying two API key ids, which the router maps to
``tenant-a`` and ``tenant-b`` (``ROUTER_IDENTITY_TENANTS``). Tenant A sends a text to the
``topics`` pipeline (its ``minilm`` step is cached); then tenant B sends the same text —
through the router to the GPU service, through the router to the CPU fallback as a
Lambda function, and as a batch job of B. B's answer must not say ``cached_steps`` and
B's request must not be served from A's entry (the step statistics count no hit), while
A's own repeat still is. A client's own ``x-spillway-tenant-scope`` header never reaches
a backend.

The router signs the scope it sends (``spillway.tenancy.proof``) with a key in Secrets
Manager (a generated secret on the moto server, rotated twice here), and each backend
door (the GPU service's HTTP and gRPC, the CPU fallback's direct invoke and HTTP) uses a
tenant's entries only for a scope whose proof verifies: a scope computed from a tenant's
name, a missing, wrong, expired or rotated-out proof gets no cache at all, while a scope
signed with the key one rotation old still does.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import serverless_wsgi
import tritonclient.grpc as grpc_client

from batch_job.runner import load_model
from batch_job.settings import JobsSettings
from spillway.fallback.app import CpuApp
from spillway.fallback.direct import handle_direct
from spillway.fallback.service import CpuService
from spillway.fallback.settings import CpuSettings
from spillway.models.engine import EngineOptions
from spillway.models.repository import LocalRepository
from spillway.pipelines.serving import PipelineJobModel, load_pipeline_version
from spillway.pipelines.stepcache import MemoryCache
from spillway.protocol.codec import encode_request
from spillway.router.settings import RouterSettings
from spillway.router.wiring import create_app
from spillway.state.table import scope
from spillway.tenancy.proof import KeyRing, ScopeProofs, StaticKeys
from spillway_cli.local import procs
from spillway_cli.local.scope_key import rotate_scope_key
from spillway_cli.local.wsgi_server import running
from tests.support import Service, gpu_service, link_model, scope_proof_secret

EVENT = Path(__file__).resolve().parents[2] / "events/router/infer-rest-v1.json"
KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}
A, B = scope("tenant-a"), scope("tenant-b")


def _texts(*items: str) -> dict[str, np.ndarray]:
    return {"text": np.array([[t.encode()] for t in items], dtype=np.object_)}


def _body(text: str) -> bytes:
    return encode_request(_texts(text), binary=False)[0]


@pytest.fixture(scope="module")
def repo(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tenant-cache-repo")
    for name in ("minilm", "topics-head", "topics"):
        link_model(models_dir, root, name)
    return root


@pytest.fixture(scope="module")
def scope_keys(moto_endpoint: str) -> Iterator[list[bytes]]:
    """The scope proof key as the storage stack makes it (a generated Secrets Manager
    secret, on the moto server), rotated twice: its three keys, oldest first (the last is
    AWSCURRENT, the middle one AWSPREVIOUS). ``SCOPE_PROOF_SECRET_ID`` and boto3's variables
    name it for every part this module starts, the GPU service's process included."""
    with scope_proof_secret(moto_endpoint) as (client, name):
        keys: list[bytes] = []
        for rotation in range(3):
            if rotation:
                rotate_scope_key(client, name)
            keys.append(client.get_secret_value(SecretId=name)["SecretString"].encode())
        yield keys


def signer(key: bytes, wall: Callable[[], float] = time.time) -> Callable[[str], str]:
    """Signs a scope as the router does, with ``key``."""
    return ScopeProofs(StaticKeys(KeyRing(key)), wall=wall).sign


@pytest.fixture(scope="module")
def gpu(
    repo: Path, tmp_path_factory: pytest.TempPathFactory, scope_keys: list[bytes]
) -> Iterator[Service]:
    """The GPU service with its gRPC door (``grpc`` is its address)."""
    port = procs.free_port()
    logs = tmp_path_factory.mktemp("tenant-cache-logs")
    with gpu_service(repo, logs, grpc_port=str(port)) as svc:
        svc.grpc = f"127.0.0.1:{port}"  # type: ignore[attr-defined]
        yield svc


@pytest.fixture(scope="module")
def cpu(repo: Path, scope_keys: list[bytes]) -> CpuService:
    return CpuService.load(CpuSettings(repository=str(repo)))


@pytest.fixture(scope="module")
def routers(gpu: Service, cpu: CpuService, moto_endpoint: str) -> Iterator[dict[str, Any]]:
    """Two routers mapping the two API keys to the two tenants: one in front of the GPU
    service, one in front of the CPU fallback (invoked as a Lambda function)."""
    tenants = json.dumps(KEYS)
    with running(CpuApp(cpu)) as cpu_url, pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ENDPOINT_URL_LAMBDA", cpu_url)
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            env.setenv(name, "testing")
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        to_gpu = RouterSettings(
            gpu_url=gpu.base, identity_tenants=tenants, metrics_log=Path("/dev/null")
        )
        to_cpu = RouterSettings(
            gpu_url=None,
            cpu_function="spillway-cpu-infer",
            identity_tenants=tenants,
            metrics_log=Path("/dev/null"),
        )
        yield {"gpu": create_app(to_gpu), "cpu": create_app(to_cpu)}


def ask(app: Any, key: str, text: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """One infer request as API Gateway hands it over for the API key ``key``; the
    answer's ``parameters`` (the steps it says were cached)."""
    event = json.loads(EVENT.read_text())
    event["path"] = "/v2/models/topics/infer"
    event["pathParameters"] = {"proxy": "models/topics/infer"}
    event["body"] = base64.b64encode(_body(text)).decode()
    event["requestContext"]["requestId"] = uuid.uuid4().hex
    event["requestContext"].setdefault("identity", {})["apiKeyId"] = key
    for name, value in (headers or {}).items():
        event["headers"][name] = value
        event["multiValueHeaders"][name] = [value]
    response = serverless_wsgi.handle_request(app, event, None)
    body = response["body"]
    if response.get("isBase64Encoded"):
        body = base64.b64decode(body)
    assert response["statusCode"] == 200, body
    parameters: dict[str, Any] = json.loads(body).get("parameters") or {}
    return parameters


def hits(base_or_cpu: str | CpuService) -> int:
    """The cache hits of the topics pipeline's embedding step so far."""
    if isinstance(base_or_cpu, CpuService):
        return base_or_cpu.pipelines.served["topics"].stats.step(0).cache_hits
    import urllib.request

    with urllib.request.urlopen(f"{base_or_cpu}/v2/models/topics/stats", timeout=30) as answer:
        entry = json.loads(answer.read())["model_stats"][0]
    return int(entry["spillway"]["steps"][0]["cache_hits"])


@pytest.mark.parametrize("backend", ["gpu", "cpu"])
def test_another_tenant_never_hits_what_one_tenant_sent(
    backend: str, routers: dict[str, Any], gpu: Service, cpu: CpuService
) -> None:
    app = routers[backend]
    counted: str | CpuService = gpu.base if backend == "gpu" else cpu
    text = f"Tenant A's private note about the merger ({backend}) is due on Friday."
    # GIVEN tenant A sent a text, and its own repeat came from its cache
    assert "cached_steps" not in ask(app, "key-a", text)
    assert ask(app, "key-a", text)["cached_steps"] == "0:minilm"
    before = hits(counted)
    # WHEN tenant B sends the same text (once claiming A's scope in a header of its own)
    started = time.perf_counter()
    answer_b = ask(app, "key-b", text)
    elapsed_ms = (time.perf_counter() - started) * 1e3
    forged = ask(app, "key-b", f"{text} ", {"x-spillway-tenant-scope": A})
    # THEN B is neither told of nor served from A's entry: its embedding was computed
    assert "cached_steps" not in answer_b
    assert "cached_steps" not in forged
    assert hits(counted) == before
    # AND B's own repeat is a hit in B's entries, A's still in A's
    assert ask(app, "key-b", text)["cached_steps"] == "0:minilm"
    assert ask(app, "key-a", text)["cached_steps"] == "0:minilm"
    assert hits(counted) == before + 2
    print(f"{backend}: tenant B's first request for tenant A's text took {elapsed_ms:.1f} ms")


def test_a_request_without_a_proven_scope_uses_no_tenants_cache(
    routers: dict[str, Any], gpu: Service
) -> None:
    text = "A note only tenant A has sent so far, about the quarterly board meeting."
    ask(routers["gpu"], "key-a", text)

    def direct(headers: dict[str, str]) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{gpu.base}/v2/models/topics/infer", _body(text), headers, method="POST"
        )
        with urllib.request.urlopen(request, timeout=60) as answer:
            parameters: dict[str, Any] = json.loads(answer.read()).get("parameters") or {}
        return parameters

    # WHEN the same text reaches the GPU service directly, twice, with no tenant scope
    # THEN neither is served from a cache: no one's entries are read or written for it
    before = hits(gpu.base)
    assert "cached_steps" not in direct({})
    assert "cached_steps" not in direct({})
    assert hits(gpu.base) == before
    # AND a scope that is no scope is refused, not served as some caller
    bad = urllib.request.Request(
        f"{gpu.base}/v2/models/topics/infer",
        _body(text),
        {"x-spillway-tenant-scope": "tenant-a"},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(bad, timeout=60)
    assert refused.value.code == 400
    assert json.loads(refused.value.read())["code"] == "invalid_input"


def test_the_direct_invoke_event_carries_the_signed_tenant(
    cpu: CpuService, scope_keys: list[bytes]
) -> None:
    text = "Direct invokes carry the tenant the router vouched for."
    sign = signer(scope_keys[-1])

    def invoke(owner: str | None) -> dict[str, Any]:
        event: dict[str, Any] = {"model": "topics", "body_b64": base64.b64encode(_body(text))}
        event["body_b64"] = event["body_b64"].decode()
        if owner is not None:
            event["tenant_scope"] = owner
        answer = handle_direct(cpu, event)
        assert answer["statusCode"] == 200, answer["body"]
        parameters: dict[str, Any] = json.loads(answer["body"]).get("parameters") or {}
        return parameters

    # GIVEN A's and B's scopes as the router signs them
    # THEN each tenant's first request computes, its repeat is its own hit
    assert "cached_steps" not in invoke(sign(A))
    assert "cached_steps" not in invoke(sign(B))
    assert invoke(sign(A)).get("cached_steps") == "0:minilm"
    # AND an unsigned event (or A's bare scope) is never served from a cache
    assert "cached_steps" not in invoke(None)
    assert "cached_steps" not in invoke(None)
    assert "cached_steps" not in invoke(A)
    assert handle_direct(cpu, {"model": "topics", "tenant_scope": "x"})["statusCode"] == 400


def test_a_batch_job_uses_its_tenants_entries(repo: Path, tmp_path: Path) -> None:
    # GIVEN one step cache (as two jobs on one host, or the shared tier, would share)
    cache = MemoryCache(64 << 20)
    repository = LocalRepository(repo)
    config = repository.read_config("topics")
    options = EngineOptions(providers=("CPUExecutionProvider",))

    def job(owner: str) -> PipelineJobModel:
        return load_pipeline_version(repository, config, 1, tmp_path, options, cache, scope=owner)

    records = _texts("Tenant A's batch of private support tickets.", "A second ticket.")
    job_a, job_b = job(A), job(B)
    job_a.run(job_a.prepare_many([records]))  # type: ignore[arg-type]
    # WHEN tenant B's job runs the same records
    job_b.run(job_b.prepare_many([records]))  # type: ignore[arg-type]
    # THEN B's job computed them (no hit in A's entries); A's rerun hits its own
    assert job_b.served.stats.step(0).cache_hits == 0
    job_a.run(job_a.prepare_many([records]))  # type: ignore[arg-type]
    assert job_a.served.stats.step(0).cache_hits == 1
    # AND the job container takes its tenant from the submitter's JOBS_TENANT_SCOPE
    plan: Any = SimpleNamespace(model="topics", model_version=1)
    settings = JobsSettings(repository=str(repo), cache_dir=tmp_path, tenant_scope=B)
    loaded = load_model(repository, settings, plan)
    assert isinstance(loaded, PipelineJobModel)
    assert loaded.scope == B


Send = Callable[[str, "str | None"], "str | None"]
"""Sends ``text`` to the topics pipeline through one door with a tenant scope value (or
none); what the answer says was cached (``None``: nothing)."""


def _http_send(base: str) -> Send:
    def send(text: str, value: str | None) -> str | None:
        headers = {} if value is None else {"x-spillway-tenant-scope": value}
        request = urllib.request.Request(
            f"{base}/v2/models/topics/infer", _body(text), headers, method="POST"
        )
        with urllib.request.urlopen(request, timeout=60) as answer:
            parameters = json.loads(answer.read()).get("parameters") or {}
        return parameters.get("cached_steps")

    return send


def _grpc_send(address: str) -> Send:
    client = grpc_client.InferenceServerClient(address)

    def send(text: str, value: str | None) -> str | None:
        tensor = grpc_client.InferInput("text", [1, 1], "BYTES")
        tensor.set_data_from_numpy(_texts(text)["text"])
        metadata = {} if value is None else {"x-spillway-tenant-scope": value}
        answer = client.infer("topics", [tensor], headers=metadata, client_timeout=60)
        parameters = answer.get_response(as_json=True).get("parameters") or {}
        cached = parameters.get("cached_steps")
        return None if cached is None else str(cached["string_param"])

    return send


def _invoke_send(cpu: CpuService) -> Send:
    def send(text: str, value: str | None) -> str | None:
        event = {"model": "topics", "body_b64": base64.b64encode(_body(text)).decode()}
        if value is not None:
            event["tenant_scope"] = value
        answer = handle_direct(cpu, event)
        assert answer["statusCode"] == 200, answer["body"]
        return (json.loads(answer["body"]).get("parameters") or {}).get("cached_steps")

    return send


@pytest.fixture(params=["gpu-http", "gpu-grpc", "cpu-invoke", "cpu-http"])
def door(
    request: pytest.FixtureRequest, gpu: Service, cpu: CpuService
) -> Iterator[tuple[Send, Callable[[], int]]]:
    """One door of a backend the router signs scopes for: how to send, how to count the
    embedding step's cache hits behind it."""
    if request.param.startswith("gpu"):
        grpc = request.param == "gpu-grpc"
        send = _grpc_send(gpu.grpc) if grpc else _http_send(gpu.base)  # type: ignore[attr-defined]
        yield send, lambda: hits(gpu.base)
    elif request.param == "cpu-invoke":
        yield _invoke_send(cpu), lambda: hits(cpu)
    else:
        with running(CpuApp(cpu)) as url:
            yield _http_send(url), lambda: hits(cpu)


def test_a_forged_scope_gets_no_hit_on_any_door(
    door: tuple[Send, Callable[[], int]], scope_keys: list[bytes]
) -> None:
    send, counted = door
    old, previous, current = scope_keys
    acme, globex = scope("acme"), scope("globex")
    text = f"acme's merger memo, draft {uuid.uuid4().hex[:8]}: the board meets on Friday."
    # GIVEN acme sent a text under the scope the router signs, and its repeat was a hit
    assert send(text, signer(current)(acme)) is None
    assert send(text, signer(current)(acme)) == "0:minilm"
    before = counted()
    # WHEN a client that reaches the door claims acme's scope without a valid proof
    expiry = int(time.time()) + 300
    globex_proof = signer(current)(globex).removeprefix(globex)
    forged = {
        "the digest of acme's name": acme,
        "no scope at all": None,
        "globex's proof on acme's scope": acme + globex_proof,
        "a made-up signature": f"{acme}.{expiry}.{'0' * 64}",
        "an expired proof": signer(current, wall=lambda: time.time() - 3600)(acme),
        "a key two rotations old": signer(old)(acme),
    }
    answers = {what: send(text, value) for what, value in forged.items()}
    # THEN none is served from (or told of) acme's entries
    assert answers == dict.fromkeys(forged)
    assert counted() == before
    # AND an unproven request writes nothing either: acme's own first request of a text
    # only forgers sent before is still computed
    fresh = f"a text only forgers sent {uuid.uuid4().hex[:8]}"
    assert [send(fresh, acme), send(fresh, acme)] == [None, None]
    assert send(fresh, signer(current)(acme)) is None
    # AND acme's scope signed with the key one rotation old (AWSPREVIOUS) still hits
    assert send(text, signer(previous)(acme)) == "0:minilm"
    # AND globex, signed, has entries of its own: computed first, then its own hit
    assert send(text, signer(current)(globex)) is None
    assert send(text, signer(current)(globex)) == "0:minilm"
    assert counted() == before + 2
