"""The OpenAI-compatible door is declared wherever the router's routes are: both templates'
API events, the router's OpenAPI document; and the router's role reads no more of the
model repository than the door needs (configurations and checksums, never a graph, a
tokenizer or a write)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from infra.checks.cfn_eval import load_cfn
from infra.checks.iam_eval import allowed, statements
from spillway.router.openai_compat.door import EMBEDDINGS, MODELS
from spillway.router.openapi import document
from tests.unit.stacks import ROOT, deploy

DOOR = {(EMBEDDINGS, "POST"), (MODELS, "GET"), (f"{MODELS}/{{id}}", "GET")}


def _sam_routes() -> set[tuple[str, str]]:
    router = load_cfn(ROOT / "template.yaml")["Resources"]["RouterFunction"]["Properties"]
    return {
        (event["Properties"]["Path"], event["Properties"]["Method"].upper())
        for event in router["Events"].values()
        if event["Type"] == "Api"
    }


def _sls_routes() -> set[tuple[str, str]]:
    config: dict[str, Any] = yaml.safe_load((ROOT / "serverless.yml").read_text("utf-8"))
    events = config["functions"]["router"]["events"]
    return {(e["http"]["path"], e["http"]["method"].upper()) for e in events if "http" in e}


def test_both_templates_route_the_doors_paths_to_the_router() -> None:
    assert _sam_routes() >= DOOR
    assert _sls_routes() >= DOOR


def test_the_openapi_document_describes_each_path_with_openais_error_shape() -> None:
    paths = document()["paths"]
    for path, method in DOOR:
        operation = paths[path][method.lower()]
        errors = {s: r for s, r in operation["responses"].items() if s.startswith(("4", "5"))}
        assert "400" in errors
        for answer in errors.values():
            assert answer["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/OpenAIError"
            }


DEPLOYMENT = deploy()
MODELS_BUCKET = DEPLOYMENT.storage.get_att("ModelsBucket", "Arn")


@pytest.mark.parametrize("stack", [DEPLOYMENT.sam, DEPLOYMENT.sls], ids=["sam", "serverless"])
@pytest.mark.parametrize(
    ("action", "key", "may"),
    [
        ("s3:GetObject", "minilm/config.json", True),
        ("s3:GetObject", "minilm/2/SHA256SUMS", True),
        ("s3:GetObject", "minilm/1/model.onnx", False),
        ("s3:GetObject", "minilm/1/tokenizer.json", False),
        ("s3:PutObject", "minilm/config.json", False),
        ("s3:DeleteObject", "minilm/1/SHA256SUMS", False),
    ],
)
def test_the_router_reads_signatures_and_nothing_else_of_the_repository(
    stack: Any, action: str, key: str, may: bool
) -> None:
    target = f"{MODELS_BUCKET}/models/{key}"
    assert allowed(statements(stack), "RouterRole", action, target) is may
