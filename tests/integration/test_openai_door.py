# ruff: noqa: E501 - the table of refusals reads best one case a line
"""The unmodified ``openai`` client against the router's OpenAI-compatible door, on
127.0.0.1: the real GPU service (the session's, on the CPU provider) and the real CPU
fallback (invoked as a Lambda function, through its invoke API) behind the router, the
router behind the REST API's API key check (``api_key_door``) with two API keys mapped to
two tenants, the models the project builds.

Vectors are compared with the same texts sent to ``POST /v2/models/minilm/infer`` through
the same router with the same key; token counts with minilm's own tokenizer file, read
here with the ``tokenizers`` library as the model's processor reads it (truncated at its
``max_sequence_length``, special tokens counted, no padding).
"""

from __future__ import annotations

import base64
import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from tokenizers import Tokenizer

from spillway.fallback.app import CpuApp
from spillway.fallback.service import CpuService
from spillway.fallback.settings import CpuSettings
from spillway.router.settings import RouterSettings
from spillway.router.wiring import create_app
from spillway_cli.local import procs
from spillway_cli.local.lambda_http import api_key_door
from spillway_cli.local.wsgi_server import running
from tests.lambda_context import LambdaContext
from tests.support import Service

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "policies" / "example.yaml"
KEYS = {"moderation-live": "key-live", "appeals": "key-appeals"}
"""Two tenants of the example policy: a premium one and a standard one."""
TEXTS = [
    "Spillway routes each request to the cheapest backend that meets its budget.",
    "Dynamic batching keeps the GPU busy.",
    "Zürich — naïve café, 東京 and emoji 🚀 count as the tokenizer says.",
    # Longer than minilm's 256-token window: the model reads (and bills) only 256.
    " ".join(["overflowing"] * 400),
]


@dataclass(frozen=True)
class Door:
    """A router behind the API key check, and its metrics log."""

    url: str
    metrics: Path

    def client(self, tenant: str) -> openai.OpenAI:
        """The stock client, as a user configures it: the base URL, and the key (which
        API Gateway reads from ``x-api-key``)."""
        key = KEYS[tenant]
        return openai.OpenAI(
            base_url=f"{self.url}/v1",
            api_key=key,
            default_headers={"x-api-key": key},
            max_retries=0,
            timeout=60,
        )

    def v2(self, tenant: str, texts: list[str]) -> np.ndarray[Any, np.dtype[np.float32]]:
        """The same texts through ``/v2`` with the same key: the vectors as float32."""
        body = {
            "inputs": [
                {"name": "text", "shape": [len(texts), 1], "datatype": "BYTES", "data": texts}
            ]
        }
        request = urllib.request.Request(
            f"{self.url}/v2/models/minilm/infer",
            json.dumps(body).encode(),
            {"content-type": "application/json", "x-api-key": KEYS[tenant]},
        )
        with urllib.request.urlopen(request, timeout=60) as answer:
            document = json.loads(answer.read())
        (output,) = document["outputs"]
        return np.array(output["data"], dtype=np.float32).reshape(output["shape"])


@pytest.fixture(scope="module")
def cpu_invoke(serving_repo: Path) -> Iterator[str]:
    """The CPU fallback with minilm, its invoke API on 127.0.0.1 (what the router's
    ``lambda:Invoke`` reaches, as ``AWS_ENDPOINT_URL_LAMBDA`` points it there)."""
    service = CpuService.load(CpuSettings(repository=str(serving_repo), models=["minilm"]))
    with running(CpuApp(service)) as url:
        yield url


def _door(gpu_url: str, cpu_invoke: str, repository: Path, logs: Path) -> Iterator[Door]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ENDPOINT_URL_LAMBDA", cpu_invoke)
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            env.setenv(name, "testing")
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        settings = RouterSettings(
            gpu_url=gpu_url,
            cpu_function="spillway-cpu-infer",
            model_repository=str(repository),
            policy_file=EXAMPLE,
            identity_tenants={key: tenant for tenant, key in KEYS.items()},
            metrics_log=logs / "metrics.jsonl",
        )
        app = api_key_door(create_app(settings), KEYS.values())
        with running(app) as url:
            yield Door(url, logs / "metrics.jsonl")


@pytest.fixture(scope="module")
def door(
    service: Service, cpu_invoke: str, serving_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Door]:
    """The router over the GPU service, the CPU fallback behind it."""
    yield from _door(service.base, cpu_invoke, serving_repo, tmp_path_factory.mktemp("door"))


@pytest.fixture(scope="module")
def gpu_down(
    cpu_invoke: str, serving_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Door]:
    """The same router whose GPU service is not there (a port nobody listens on)."""
    nowhere = f"http://127.0.0.1:{procs.free_port()}"
    yield from _door(nowhere, cpu_invoke, serving_repo, tmp_path_factory.mktemp("down"))


@pytest.fixture(scope="module")
def tokens(serving_repo: Path) -> Tokenizer:
    """minilm's tokenizer, set up here as its config says (``max_sequence_length``)."""
    config = json.loads((serving_repo / "minilm" / "config.json").read_text())
    block = config["spillway"]
    tokenizer = Tokenizer.from_file(str(serving_repo / "minilm" / "1" / block["tokenizer_file"]))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=block["max_sequence_length"])
    return tokenizer


def _count(tokenizer: Tokenizer, texts: list[str]) -> int:
    return sum(len(encoding.ids) for encoding in tokenizer.encode_batch(texts))


def _float32(data: str) -> np.ndarray[Any, np.dtype[np.float32]]:
    return np.frombuffer(base64.b64decode(data), dtype="<f4")


@pytest.mark.parametrize("tenant", sorted(KEYS))
@pytest.mark.parametrize("texts", [TEXTS[:1], TEXTS], ids=["single", "batch"])
def test_the_client_gets_the_v2_vectors_and_the_tokenizers_count(
    door: Door, tokens: Tokenizer, tenant: str, texts: list[str]
) -> None:
    # GIVEN the stock openai client with one tenant's key, and the /v2 answer to the texts
    client = door.client(tenant)
    expected = door.v2(tenant, texts)
    counted = _count(tokens, texts)
    single: str | list[str] = texts[0] if len(texts) == 1 else texts
    # WHEN it asks for floats, for base64, and for its default (base64, decoded by it)
    floats = client.embeddings.with_raw_response.create(
        model="minilm", input=single, encoding_format="float"
    )
    packed = client.embeddings.create(model="minilm", input=single, encoding_format="base64")
    default = client.embeddings.create(model="minilm", input=single)
    # THEN every form holds the /v2 vectors, in order
    parsed = floats.parse()
    assert [d.index for d in parsed.data] == list(range(len(texts)))
    for answer in (parsed, default):
        got = np.array([d.embedding for d in answer.data], dtype=np.float32)
        np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0)
    got = np.stack([_float32(str(d.embedding)) for d in packed.data])
    np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0)
    # AND the usage is the count of minilm's own tokenizer (the long text: 256 only)
    for answer in (parsed, packed, default):
        assert (answer.usage.prompt_tokens, answer.usage.total_tokens) == (counted, counted)
        assert answer.model == "minilm"
    # AND the answer says how it was routed, as a /v2 answer does: the tenant's rule
    rule = "premium-tenants" if tenant == "moderation-live" else "default"
    assert floats.headers["x-spillway-rule"] == rule
    assert floats.headers["x-spillway-backend"] == "gpu"
    assert float(floats.headers["x-spillway-cost-usd"]) > 0


def test_each_tenants_requests_are_routed_and_accounted_as_its_own(door: Door) -> None:
    # GIVEN the router's metrics log so far
    before = len(door.metrics.read_text().splitlines()) if door.metrics.exists() else 0
    # WHEN each tenant embeds through the door
    for tenant in sorted(KEYS):
        door.client(tenant).embeddings.create(model="minilm", input=TEXTS[:2])
    # THEN the router accounted one routed request for each, under the tenant's rule, with
    # its cost and the model as a metric dimension, as for any /v2 request
    lines = [json.loads(line) for line in door.metrics.read_text().splitlines()[before:]]
    routed = [line for line in lines if "rule" in line]
    assert [(r["rule"], r["backend"], r["model"]) for r in routed] == [
        ("default", "gpu", "minilm"),
        ("premium-tenants", "gpu", "minilm"),
    ]
    assert all(r["CostUSD"] == [pytest.approx(r["CostUSD"][0])] for r in routed)
    assert all(r["CostUSD"][0] > 0 and r["status"] == 200 for r in routed)


def test_with_the_gpu_service_down_the_cpu_fallback_answers_the_same(
    gpu_down: Door, tokens: Tokenizer
) -> None:
    # GIVEN a router whose GPU service cannot be reached
    client = gpu_down.client("appeals")
    # WHEN the client embeds a batch
    raw = client.embeddings.with_raw_response.create(
        model="minilm", input=TEXTS, encoding_format="float"
    )
    answer = raw.parse()
    # THEN the CPU fallback served it, said so, and its vectors and count are /v2's
    assert raw.headers["x-spillway-backend"] == "cpu"
    assert raw.headers["x-spillway-fallback"] == "gpu:connect_error"
    got = np.array([d.embedding for d in answer.data], dtype=np.float32)
    np.testing.assert_allclose(got, gpu_down.v2("appeals", TEXTS), atol=1e-6, rtol=0)
    assert answer.usage.prompt_tokens == _count(tokens, TEXTS)


def test_both_tenants_see_the_text_embedding_models_only(door: Door) -> None:
    for tenant in sorted(KEYS):
        client = door.client(tenant)
        # WHEN a tenant lists the models, and asks for one
        listed = client.models.list().data
        one = client.models.retrieve("minilm")
        # THEN it sees minilm alone (digits, mlp-bench and the slow model are no
        # text_embedding models), the platform's, as every tenant does
        assert [(m.id, m.object, m.owned_by) for m in listed] == [("minilm", "model", "spillway")]
        assert (one.id, one.created) == ("minilm", listed[0].created)
        assert one.created > 1_600_000_000


@pytest.mark.parametrize(
    ("call", "error", "code", "param"),
    [
        (lambda c: c.embeddings.create(model="digits", input="x"), openai.NotFoundError, "model_not_found", "model"),
        (lambda c: c.embeddings.create(model="nosuch", input="x"), openai.NotFoundError, "model_not_found", "model"),
        (lambda c: c.embeddings.create(model="../minilm", input="x"), openai.BadRequestError, "invalid_model_name", "model"),
        (lambda c: c.embeddings.create(model="minilm", input=""), openai.BadRequestError, "invalid_input", "input"),
        (lambda c: c.embeddings.create(model="minilm", input=[]), openai.BadRequestError, "invalid_input", "input"),
        (lambda c: c.embeddings.create(model="minilm", input=[101, 2023]), openai.BadRequestError, "invalid_input", "input"),
        (lambda c: c.embeddings.create(model="minilm", input=["x"] * 65), openai.BadRequestError, "batch_too_large", "input"),
        (lambda c: c.embeddings.create(model="minilm", input="x", dimensions=128), openai.BadRequestError, "invalid_input", "dimensions"),
        (lambda c: c.models.retrieve("digits"), openai.NotFoundError, "model_not_found", "model"),
    ],
    ids=["other kind", "unknown", "traversal", "empty", "no texts", "token ids", "65 texts", "dimensions", "retrieve other kind"],
)  # fmt: skip
def test_refusals_reach_the_client_in_openais_shape(
    door: Door, call: Any, error: type[openai.APIStatusError], code: str, param: str
) -> None:
    # WHEN the client sends what the door refuses
    with pytest.raises(error) as refused:
        call(door.client("appeals"))
    # THEN it raises the class of the status, with Spillway's code and the field at fault
    assert (refused.value.code, refused.value.param) == (code, param)
    assert refused.value.type == "invalid_request_error"
    assert refused.value.message


def test_a_wrong_key_never_reaches_the_router(door: Door) -> None:
    client = openai.OpenAI(
        base_url=f"{door.url}/v1",
        api_key="key-guessed",
        default_headers={"x-api-key": "key-guessed"},
        max_retries=0,
    )
    with pytest.raises(openai.PermissionDeniedError):
        client.embeddings.create(model="minilm", input="x")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("embeddings-rest-v1.json", lambda body: body["usage"]["prompt_tokens"] == 7),
        ("models-rest-v1.json", lambda body: [m["id"] for m in body["data"]] == ["minilm"]),
        ("model-rest-v1.json", lambda body: body["id"] == "minilm"),
    ],
)
def test_the_events_sam_local_invoke_sends_are_answered_by_the_handler(
    service: Service,
    serving_repo: Path,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    name: str,
    expected: Any,
) -> None:
    # GIVEN the router Lambda's handler over the GPU service and the repository
    import functions.router.handler as router_handler

    settings = RouterSettings(
        gpu_url=service.base, model_repository=str(serving_repo), metrics_log=tmp_path / "m"
    )
    monkeypatch.setattr(router_handler, "app", create_app(settings))
    # WHEN it serves the API Gateway event of events/router
    event = json.loads((ROOT / "events" / "router" / name).read_text())
    response = router_handler.handler(event, LambdaContext())
    # THEN the door answered it
    assert response["statusCode"] == 200, response.get("body")
    assert expected(json.loads(response["body"]))
