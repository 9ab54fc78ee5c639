"""The env-vars file ``spillway up`` writes for ``sam local invoke``: the template's variable
names, function by function, with the local stack's values; every variable SAM cannot
resolve locally has one (else the function starts with an empty URL or a logical id)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from infra.checks.cfn_eval import load_cfn
from spillway_cli.local.layout import Ports
from spillway_cli.local.sam_env import (
    TEMPLATE,
    env_vars_document,
    function_variables,
    load_template,
    local_values,
    write_env_vars,
)
from spillway_cli.local.stack import LocalStack

FUNCTIONS = {"RouterFunction", "CpuInferFunction", "JobsFunction", "WebSocketFunction"}


@pytest.fixture
def stack(tmp_path: Path) -> LocalStack:
    """A stack description (not started) on fixed ports."""
    return LocalStack(tmp_path / "models", tmp_path / "logs", Ports(5000, 8000, 8081, 8082, 8080))


def _raw_variables(template: dict[str, Any], function: str) -> dict[str, Any]:
    shared = template["Globals"]["Function"]["Environment"]["Variables"]
    own = template["Resources"][function]["Properties"]["Environment"]["Variables"]
    return {**shared, **own}


def _resolvable(template: dict[str, Any], value: Any) -> bool:
    """Whether SAM gives the deployed value locally: a literal, or a parameter's default."""
    if isinstance(value, str | int | float | bool):
        return True
    return isinstance(value, dict) and value.get("Ref") in template.get("Parameters", {})


def test_names_come_from_the_template_globals_first() -> None:
    template = load_template()
    names = function_variables(template)
    assert set(names) == FUNCTIONS
    shared = list(template["Globals"]["Function"]["Environment"]["Variables"])
    for function, declared in names.items():
        assert declared[: len(shared)] == shared
        own = template["Resources"][function]["Properties"]["Environment"]["Variables"]
        assert set(declared) == set(shared) | set(own)


@pytest.mark.parametrize("function", sorted(FUNCTIONS))
def test_every_variable_sam_cannot_resolve_has_a_local_value(
    stack: LocalStack, function: str
) -> None:
    # GIVEN the template's variables as written (intrinsics and all)
    template = load_cfn(TEMPLATE)
    raw = _raw_variables(template, function)
    values = local_values(stack)
    # WHEN SAM could not give one its deployed value (an import, an attribute, a resource)
    unresolved = {name for name, value in raw.items() if not _resolvable(template, value)}
    # THEN the local stack has a value for it
    assert unresolved <= set(values), f"no local value for {sorted(unresolved - set(values))}"


def test_the_document_points_each_function_at_the_stack(stack: LocalStack) -> None:
    document = env_vars_document(local_values(stack), load_template())
    assert set(document) == FUNCTIONS
    for variables in document.values():
        assert variables["AWS_ENDPOINT_URL"] == "http://127.0.0.1:5000"
    router = document["RouterFunction"]
    assert router["ROUTER_GPU_URL"] == "http://127.0.0.1:8000"
    assert router["AWS_ENDPOINT_URL_LAMBDA"] == "http://127.0.0.1:8081"
    assert router["ROUTER_CPU_FUNCTION"] == "spillway-cpu-infer"
    assert document["CpuInferFunction"]["CPU_REPOSITORY"] == "s3://spillway-models/repository"
    assert document["JobsFunction"]["JOBS_TABLE"] == "spillway-jobs"
    websocket = document["WebSocketFunction"]
    assert websocket["WS_MANAGEMENT_ENDPOINT"] == stack.url("websocket")
    assert websocket["ROUTER_STATE_TABLE"] == router["ROUTER_STATE_TABLE"]


def test_a_name_the_template_does_not_declare_is_left_out(stack: LocalStack) -> None:
    # SAM would drop it: a function only gets what its template declares
    document = env_vars_document(local_values(stack), load_template())
    assert "ROUTER_GPU_URL" not in document["CpuInferFunction"]
    assert "CPU_REPOSITORY" not in document["RouterFunction"]
    declared = function_variables(load_template())
    for function, variables in document.items():
        assert set(variables) <= set(declared[function])


def test_the_file_is_written_whole(stack: LocalStack, tmp_path: Path) -> None:
    path = write_env_vars(stack, tmp_path / "out" / "sam-env.json")
    assert json.loads(path.read_text()) == env_vars_document(local_values(stack), load_template())
    assert not list(path.parent.glob("*.partial"))
