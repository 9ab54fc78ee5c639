"""The ``--env-vars`` file of ``sam local invoke``: template.yaml's functions pointed at the
local stack.

SAM builds a function's environment from the template's ``Environment.Variables``
(``Globals`` merged in). A value SAM cannot resolve locally (``!ImportValue``, ``!GetAtt``,
a ``!Sub`` over either) becomes an empty string, a ``!Ref`` to a resource becomes its
logical id, and an env-vars file may override only the names the template declares: a
name it does not declare is dropped. So the names here come from the template, function by
function, and only their local values are mapped; a variable added to the template later
is written as soon as it has a local value (tests/unit/test_sam_env.py fails until then).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import yaml

from spillway_cli.local.names import (
    CAPTURE_ROOT,
    DATA_BUCKET,
    POLICY_PARAMETER,
    REPOSITORY,
    SCOPE_PROOF_KEY_NAME,
    STATE_TABLE,
    TENANTS_ROOT,
)

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "template.yaml"
FUNCTION_TYPE = "AWS::Serverless::Function"


class _KeysLoader(yaml.SafeLoader):
    """Reads a CloudFormation template for its keys: every intrinsic function (``!Ref``,
    ``!Sub`` ...) loads as None, since only the variable names matter here."""


_KeysLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def load_template(path: Path = TEMPLATE) -> dict[str, Any]:
    """The template with its intrinsic functions as None."""
    document: dict[str, Any] = yaml.load(path.read_text(encoding="utf-8"), Loader=_KeysLoader)  # noqa: S506 - a SafeLoader
    return document


def _names(properties: Mapping[str, Any] | None) -> list[str]:
    environment = (properties or {}).get("Environment") or {}
    return list(environment.get("Variables") or {})


def function_variables(template: Mapping[str, Any]) -> dict[str, list[str]]:
    """Each function's environment variable names (logical id -> names), Globals first."""
    shared = _names(template.get("Globals", {}).get("Function"))
    return {
        logical_id: [*shared, *(n for n in _names(resource.get("Properties")) if n not in shared)]
        for logical_id, resource in template["Resources"].items()
        if resource.get("Type") == FUNCTION_TYPE
    }


def env_vars_document(
    values: Mapping[str, str], template: Mapping[str, Any]
) -> dict[str, dict[str, str]]:
    """SAM's env-vars format (``{"<logical id>": {"NAME": "value"}}``): every variable the
    template declares for a function that has a local value."""
    return {
        function: {name: values[name] for name in names if name in values}
        for function, names in function_variables(template).items()
    }


class StackEndpoints(Protocol):
    """What the env-vars file needs of a running ``spillway_cli.local.stack.LocalStack``."""

    @property
    def async_vars(self) -> Mapping[str, str]:
        """The ``ASYNC_*`` variables of the stack's async resources (empty until made)."""
        ...

    def url(self, part: str) -> str:
        """The base URL of one part (``moto``, ``gpu``, ``cpu`` ...)."""
        ...

    def trace_env(self, part: str) -> Mapping[str, str]:
        """The OpenTelemetry variables of a traced part (its OTLP endpoint: the stack's
        trace receiver, when it runs one)."""
        ...


def local_values(stack: StackEndpoints) -> dict[str, str]:
    """What each template variable is on the local stack, by name.

    Containers run on the host's network (``sam local invoke --docker-network host``), so
    the stack's 127.0.0.1 addresses hold inside them too. The Lambda invoke endpoint is
    the CPU fallback's server, which answers for that function alone: the router's batch
    mode, which invokes the jobs function, is left off (400 ``mode_unavailable``).
    """
    from batch_job.settings import JobsSettings
    from spillway.async_inference.settings import ENV_PREFIX, AsyncSettings
    from spillway.fallback.settings import CpuSettings

    jobs = JobsSettings()
    # The async queue, table and prefix exist once the stack has started them
    # (stack.async_vars); until then their variables are empty, which turns async mode off.
    no_async = {f"{ENV_PREFIX}{name.upper()}": "" for name in AsyncSettings.model_fields}
    return {
        **no_async,
        **stack.async_vars,
        "AWS_ENDPOINT_URL": stack.url("moto"),
        "AWS_ENDPOINT_URL_LAMBDA": stack.url("cpu"),
        "ROUTER_GPU_URL": stack.url("gpu"),
        "ROUTER_CPU_FUNCTION": CpuSettings().function_name,
        "ROUTER_JOBS_FUNCTION": "",
        "ROUTER_JOBS_STAGING": f"s3://{DATA_BUCKET}/staging/router",
        "ROUTER_POLICY_PARAMETER": POLICY_PARAMETER,
        "ROUTER_STATE_TABLE": STATE_TABLE,
        # The OpenAI-compatible door reads the local repository itself, not a parameter.
        "ROUTER_MODEL_REPOSITORY": REPOSITORY,
        "ROUTER_MODEL_REPOSITORY_PARAMETER": "",
        "ROUTER_CAPTURE_ROOT": CAPTURE_ROOT,
        "SCOPE_PROOF_SECRET_ID": SCOPE_PROOF_KEY_NAME,
        # Spans go to the stack's trace receiver (empty without one: tracing off).
        "OTEL_EXPORTER_OTLP_ENDPOINT": stack.trace_env("router").get(
            "OTEL_EXPORTER_OTLP_ENDPOINT", ""
        ),
        # The WebSocket function pushes answers to the local gateway's @connections API.
        "WS_MANAGEMENT_ENDPOINT": stack.url("websocket"),
        "CPU_REPOSITORY": REPOSITORY,
        "JOBS_TABLE": jobs.table,
        "JOBS_JOB_QUEUE": jobs.job_queue,
        "JOBS_JOB_DEFINITION": jobs.job_definition,
        "JOBS_REPOSITORY": REPOSITORY,
        "JOBS_TENANTS_ROOT": TENANTS_ROOT,
        "JOBS_STAGING": f"s3://{DATA_BUCKET}/staging/router",
        # The live configuration (identity map, log level): the state table's item.
        "JOBS_CONFIG_TABLE": STATE_TABLE,
        "CPU_CONFIG_TABLE": STATE_TABLE,
        "JOBS_SCHEDULE_MODEL": "digits",
        "JOBS_SCHEDULE_INPUT": f"s3://{DATA_BUCKET}/nightly/input/",
        "JOBS_SCHEDULE_OUTPUT": f"s3://{DATA_BUCKET}/nightly/output/",
    }


def write_env_vars(stack: StackEndpoints, path: Path, template: Path = TEMPLATE) -> Path:
    """Write the env-vars file for ``stack`` (atomically: a reader never sees half)."""
    document = env_vars_document(local_values(stack), load_template(template))
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    partial.replace(path)
    return path
