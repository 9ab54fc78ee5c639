"""The OpenAI-compatible door's parts without a router: the request model, the V2 request
and answer it maps to, the error shape, the catalogue's cache, the decision without
batch, and the token count every server's answer carries."""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from tokenizers.processors import TemplateProcessing

from spillway import inference
from spillway.models.config import ModelConfig
from spillway.models.processing import TextEmbeddingProcessor, TextPrepared
from spillway.models.repository import LocalRepository
from spillway.policy.decision import Decision, without_batch
from spillway.policy.rules import parse_policy
from spillway.protocol.errors import (
    InferenceError,
    ModelNotFoundError,
    OverloadedError,
    UnavailableError,
)
from spillway.protocol.replies import Reply, error_reply
from spillway.router.openai_compat.catalog import EmbeddingCatalog, EmbeddingModel, Expiring
from spillway.router.openai_compat.errors import error_type, openai_reply
from spillway.router.openai_compat.schema import (
    MAX_INPUT_CHARS,
    MAX_INPUTS,
    FieldRefused,
    embeddings_body,
    float32_base64,
    read_answer,
    read_request,
    v2_request,
)
from tests.unit.openai_support import (
    DIMENSIONS,
    embedder_config,
    publish,
    repository,
    v2_answer,
    vector,
)

MODEL = EmbeddingModel("minilm", "text", "embedding", DIMENSIONS, 8, 1_700_000_000)


def _body(**fields: Any) -> bytes:
    return json.dumps({"model": "minilm", "input": "hello", **fields}).encode()


# --- the request ---------------------------------------------------------------------------


def test_one_text_is_read_as_a_list_of_one_and_optional_fields_default() -> None:
    request = read_request(_body())
    assert (request.input, request.encoding_format, request.dimensions) == (["hello"], None, None)
    assert read_request(_body(input=["a", "b"], user="u-1")).input == ["a", "b"]


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"input": [101, 2023]}, "input", "token id arrays are not accepted"),
        ({"input": [[101, 2023]]}, "input", "token id arrays are not accepted"),
        ({"input": ""}, "input", "at least 1 character"),
        ({"input": ["fine", "  \n"]}, "input", "text 1 is empty or only white space"),
        ({"input": []}, "input", "at least 1 item"),
        ({"input": ["x"] * (MAX_INPUTS + 1)}, "input", f"at most {MAX_INPUTS} items"),
        ({"input": "x" * (MAX_INPUT_CHARS + 1)}, "input", f"at most {MAX_INPUT_CHARS} characters"),
        ({"input": ["ok", None]}, "input", "valid string"),
        ({"input": True}, "input", "valid list"),
        ({"model": 7}, "model", "valid string"),
        ({"encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
        ({"dimensions": "384"}, "dimensions", "valid integer"),
        ({"dimensions": True}, "dimensions", "valid integer"),
        ({"dimensions": 0}, "dimensions", "greater than or equal to 1"),
        ({"user": "u" * 257}, "user", "at most 256 characters"),
        ({"temperature": 0.5}, "temperature", "Extra inputs are not permitted"),
    ],
)
def test_every_field_is_checked_strictly_and_named(
    fields: dict[str, Any], param: str, says: str
) -> None:
    # WHEN a request carries a field the door refuses
    with pytest.raises(FieldRefused) as refused:
        read_request(_body(**fields))
    # THEN the refusal names the field (OpenAI's param) and says why, as a 400
    assert refused.value.param == param
    assert says in refused.value.error.message
    assert (refused.value.error.status, refused.value.error.code) == (400, "invalid_input")


@pytest.mark.parametrize(
    "body",
    [b"{not json", b"[1, 2]", b'{"model": "minilm", "input": "\\ud800"}', b"\xff\xfe"],
    ids=["bad JSON", "not an object", "lone surrogate", "not UTF-8"],
)
def test_a_body_that_is_no_json_object_is_the_clients_400(body: bytes) -> None:
    from spillway.protocol.errors import InvalidInputError

    with pytest.raises(InvalidInputError):
        read_request(body)


def test_the_v2_request_has_one_text_per_row_of_the_models_own_input() -> None:
    document = json.loads(v2_request(MODEL, ["a", "b", "c"]))
    assert document == {
        "inputs": [{"name": "text", "shape": [3, 1], "datatype": "BYTES", "data": ["a", "b", "c"]}],
        "outputs": [{"name": "embedding"}],
    }


# --- the answer ----------------------------------------------------------------------------


def test_the_answer_gives_one_vector_per_text_in_order_and_the_token_count() -> None:
    vectors, tokens = read_answer(v2_answer(3, tokens=11), MODEL, 3)
    assert (vectors, tokens) == ([vector(0), vector(1), vector(2)], 11)


def test_nested_data_is_read_as_row_major() -> None:
    document = json.loads(v2_answer(2))
    document["outputs"][0]["data"] = [vector(0), vector(1)]
    assert read_answer(json.dumps(document).encode(), MODEL, 2)[0] == [vector(0), vector(1)]


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (v2_answer(2, tokens=None), "carries no token_count"),
        (v2_answer(2, shape=[2, 3]), "has shape [2, 3]"),
        (v2_answer(1), "has shape [1, 4]"),
        (b"<html>bad gateway</html>", "not a JSON infer response"),
        (b'{"outputs": [{"name": "other"}]}', "no FP32 output 'embedding'"),
    ],
    ids=["no count", "wrong size", "wrong rows", "not JSON", "no such output"],
)
def test_an_answer_without_vectors_or_count_is_the_servers_fault(answer: bytes, says: str) -> None:
    with pytest.raises(InferenceError, match=re.escape(says)):
        read_answer(answer, MODEL, 2)


@given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), max_size=64))
def test_base64_is_the_little_endian_float32_bytes_the_client_decodes(values: list[float]) -> None:
    decoded = np.frombuffer(base64.b64decode(float32_base64(values)), dtype="<f4")
    np.testing.assert_array_equal(decoded, np.array(values, dtype=np.float32))


def test_the_embeddings_body_is_openais_shape() -> None:
    body = embeddings_body("minilm", [vector(0), vector(1)], "float", 9)
    assert body == {
        "object": "list",
        "data": [
            {"object": "embedding", "index": 0, "embedding": vector(0)},
            {"object": "embedding", "index": 1, "embedding": vector(1)},
        ],
        "model": "minilm",
        "usage": {"prompt_tokens": 9, "total_tokens": 9},
    }
    packed = embeddings_body("minilm", [vector(1)], "base64", 9)["data"][0]["embedding"]
    assert packed == float32_base64(vector(1))


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (404, "invalid_request_error"),
        (405, "invalid_request_error"),
        (413, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (429, "rate_limit_error"),
        (500, "server_error"),
        (503, "server_error"),
        (504, "server_error"),
    ],
)
def test_the_type_follows_the_status(status: int, kind: str) -> None:
    assert error_type(status) == kind


def test_a_v2_error_becomes_openais_shape_with_its_code_and_headers() -> None:
    # GIVEN a routed 429 as the router writes it (Retry-After, routing headers)
    routed = error_reply(OverloadedError("queue full", retry_after_s=2))
    reply = Reply(429, [*routed.headers, ("x-spillway-backend", "gpu")], routed.body)
    # WHEN the door answers it
    answer = openai_reply(reply, "input")
    # THEN the status and headers stay, and the body is OpenAI's with Spillway's code
    assert answer.status == 429
    assert answer.header("retry-after") == "2"
    assert answer.header("x-spillway-backend") == "gpu"
    assert json.loads(answer.body) == {
        "error": {
            "message": "queue full",
            "type": "rate_limit_error",
            "param": "input",
            "code": "overloaded",
        }
    }


def test_a_body_of_another_shape_still_answers_in_openais() -> None:
    answer = openai_reply(Reply(502, [("content-type", "text/html")], b"<html>"))
    assert answer.header("content-type") == "application/json"
    assert json.loads(answer.body)["error"] == {
        "message": "the request failed with HTTP 502",
        "type": "server_error",
        "param": None,
        "code": "internal",
    }


def test_a_success_passes_unchanged() -> None:
    reply = Reply(200, [("content-type", "application/json")], b"{}")
    assert openai_reply(reply) is reply


# --- the catalogue -------------------------------------------------------------------------


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


class Counting(LocalRepository):
    """A local repository that counts its reads."""

    reads = 0

    def read_config(self, model: str) -> ModelConfig:
        Counting.reads += 1
        return super().read_config(model)


def _catalog(root: Path, clock: Clock) -> EmbeddingCatalog:
    return EmbeddingCatalog(
        lambda: str(root), lambda where: Counting(Path(where)), ttl_s=60, clock=clock
    )


def test_the_catalogue_offers_text_embedding_models_that_take_a_batch(tmp_path: Path) -> None:
    catalog = _catalog(repository(tmp_path), Clock())
    (minilm,) = catalog.models()
    assert (minilm.name, minilm.text_input, minilm.output) == ("minilm", "text", "embedding")
    assert (minilm.dimensions, minilm.max_inputs) == (DIMENSIONS, 8)
    sums = tmp_path / "minilm" / "1" / "SHA256SUMS"
    assert minilm.created == int(sums.stat().st_mtime)
    with pytest.raises(ModelNotFoundError, match="its kind is image_classifier"):
        catalog.model("digits")
    with pytest.raises(ModelNotFoundError, match="max_batch_size 0"):
        catalog.model("single")
    with pytest.raises(ModelNotFoundError, match="not in the repository"):
        catalog.model("nosuch")


def test_reads_are_kept_for_the_ttl_then_a_new_model_appears(tmp_path: Path) -> None:
    clock = Clock()
    catalog = _catalog(repository(tmp_path), clock)
    assert [m.name for m in catalog.models()] == ["minilm"]
    Counting.reads = 0
    # WHEN another embedder is published within the TTL, and a name is asked for twice
    publish(tmp_path, embedder_config("e5"))
    listed = [m.name for m in catalog.models()]
    for _ in range(2):
        with pytest.raises(ModelNotFoundError):
            catalog.model("nosuch")
    # THEN the list is the one read, and the unknown name was read once, then remembered
    assert (listed, Counting.reads) == (["minilm"], 1)
    # WHEN the TTL passes
    clock.now += 61
    # THEN the new model is offered
    assert [m.name for m in catalog.models()] == ["e5", "minilm"]


def test_an_unreadable_repository_is_a_503_that_is_read_again(tmp_path: Path) -> None:
    calls: list[str] = []

    def locate() -> str:
        calls.append("locate")
        return str(tmp_path / "gone")

    catalog = EmbeddingCatalog(locate, lambda where: LocalRepository(Path(where)), ttl_s=60)
    with pytest.raises(UnavailableError) as refused:
        catalog.models()
    assert refused.value.retry_after_s == 1.0
    with pytest.raises(UnavailableError):
        catalog.model("minilm")
    # the location is kept for the TTL; a failed read is not
    assert calls == ["locate"]


def test_a_read_shared_by_waiters_delivers_one_answer() -> None:
    cache: Expiring[str, int] = Expiring(2, Clock())
    reads: list[int] = []

    def read() -> tuple[int, float]:
        reads.append(1)
        return len(reads), 10.0

    assert [cache.get("k", read), cache.get("k", read)] == [1, 1]
    assert cache.get("j", read) == 2
    assert cache.get("i", read) == 3  # the least recently used ("k") goes
    assert cache.get("k", read) == 4


# --- routing without batch -----------------------------------------------------------------


def test_without_batch_keeps_the_chain_or_falls_to_the_gpu_chain() -> None:
    rules = '[{"name": "default", "route": "gpu"}]'
    policy = parse_policy(f'{{"version": 1, "fallbacks": {{"gpu": ["cpu"]}}, "rules": {rules}}}')
    assert without_batch(policy, Decision("r", ("gpu", "cpu"))) == Decision("r", ("gpu", "cpu"))
    assert without_batch(policy, Decision("r", ("batch", "cpu"))) == Decision("r", ("cpu",))
    assert without_batch(policy, Decision("r", ("batch",), True)) == Decision(
        "r", ("gpu", "cpu"), True
    )


# --- the token count in every server's answer ----------------------------------------------


@dataclass(frozen=True)
class Named:
    """What ``inference.encode`` reads of a model: its name and version."""

    name: str = "tiny"
    version: int = 3


def _tiny_text_model(root: Path) -> TextEmbeddingProcessor:
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "spill": 3, "way": 4, "routes": 5}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))  # noqa: S106 - a vocabulary word
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.post_processor = TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)]
    )
    tokenizer.save(str(root / "tokenizer.json"))
    config = {**embedder_config("tiny"), "spillway": {**embedder_config()["spillway"]}}
    config["spillway"]["max_sequence_length"] = 5
    return TextEmbeddingProcessor(ModelConfig.model_validate(config), root)


def test_a_text_requests_answer_carries_the_tokens_the_model_read(tmp_path: Path) -> None:
    # GIVEN a text model whose tokenizer adds [CLS] and [SEP] and which reads 5 tokens
    processor = _tiny_text_model(tmp_path)
    texts = np.array([[b"spill way"], [b"spill way routes spill way routes"]], dtype=object)
    # WHEN a request of two texts is prepared and its answer encoded
    prepared = processor.prepare({"text": texts}, 2)
    decoded = inference.decode(v2_request(MODEL, ["a", "b"]), None)
    admitted = inference.Admitted(decoded, prepared, ["embedding"], set())
    result = {"embedding": np.zeros((2, DIMENSIONS), dtype=np.float32)}
    encoded = inference.encode(Named(), admitted, result)  # type: ignore[arg-type]
    # THEN it counts 4 + 5 tokens (the second truncated to 5, specials counted, no padding)
    assert isinstance(prepared, TextPrepared)
    assert prepared.tokens == 9
    assert json.loads(encoded.body)["parameters"] == {"token_count": 9}
