"""The zip functions (router, jobs) as Lambda starts them with the Tracing parameter on:
CPython 3.12 (the runtime's version) with the function's code and the built dependency
layer on its path and nothing else, in the environment Lambda gives the function.
Powertools' tracer imports aws-xray-sdk at init, so a layer without it fails every cold
start (ModuleNotFoundError)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYER = ROOT / ".aws-sam" / "build" / "LambdaDepsLayer" / "python"  # `make check-infra`
PINS = ROOT / "infra" / "lambda" / "requirements.txt"
TRACE_ROOT = (
    "1-5759e988-bd862e3fe1be46a994272793"  # the invocation's X-Ray trace, as Lambda sets it
)

# -I -S: no site-packages, no PYTHONPATH; the code and the layer are the whole path, in
# Lambda's order (/var/task, then /opt/python).
_PROBE = """
import json, sys
sys.path[:0] = sys.argv[1:3]
import importlib
module = importlib.import_module(sys.argv[4])
import aws_xray_sdk
from aws_lambda_powertools.tracing import Tracer

class Context:
    function_name = "spillway-router"
    function_version = "$LATEST"
    invoked_function_arn = "arn:aws:lambda:us-east-1:123456789012:function:spillway-router"
    memory_limit_in_mb = 512
    aws_request_id = "0b8e4c1e-2d47-4c7b-9a53-8f0a4d1e6c21"
    def get_remaining_time_in_millis(self):
        return 20000

with open(sys.argv[3]) as event:
    answer = module.handler(json.load(event), Context())
print(json.dumps({
    "tracing": module.settings.tracing,
    "tracer_disabled": Tracer().disabled,
    "handler_traced": hasattr(module.handler, "__wrapped__"),
    "xray_from": aws_xray_sdk.__file__,
    "status": answer["statusCode"],
}))
"""


def python312() -> Path:
    """The machine's CPython 3.12 (pyenv builds it): the Lambda runtime's version."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    found = sorted(root.glob("versions/3.12.*/bin/python3.12"))
    if not found:
        pytest.fail(f"no CPython 3.12 under {root}/versions: `pyenv install 3.12`")
    return found[-1]


def _has_pins(layer: Path) -> bool:
    """Whether the layer holds every pinned distribution at its pinned version."""
    pins = [
        line.split("==")
        for line in PINS.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    present = {p.name.lower() for p in layer.glob("*.dist-info")} if layer.is_dir() else set()
    return all(f"{n.lower().replace('-', '_')}-{v}.dist-info" in present for n, v in pins)


@pytest.fixture(scope="module")
def layer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The layer `make check-infra` built, or a fresh build when it is missing or older
    than the pins."""
    if _has_pins(LAYER):
        return LAYER
    out = tmp_path_factory.mktemp("layer")
    subprocess.run(
        ["make", "-s", "-f", "infra/lambda/Makefile", "build-LambdaDepsLayer",
         f"ARTIFACTS_DIR={out}", f"PYTHON={sys.executable}"],
        cwd=ROOT, check=True, timeout=900, capture_output=True,
    )  # fmt: skip
    assert _has_pins(out / "python")
    return out / "python"


def _anonymous_status(folder: Path) -> Path:
    """The jobs status event with nothing vouching for the caller: 401 before any AWS call."""
    event = json.loads((ROOT / "events" / "jobs" / "status.json").read_text())
    event["requestContext"]["identity"]["apiKeyId"] = None
    path = folder / "status-anonymous.json"
    path.write_text(json.dumps(event))
    return path


@pytest.mark.parametrize(
    ("module", "prefix", "status"),
    [("functions.router.handler", "ROUTER", 200), ("functions.jobs.handler", "JOBS", 401)],
)
def test_function_starts_with_tracing_on_from_the_built_layer(
    layer: Path, tmp_path: Path, module: str, prefix: str, status: int
) -> None:
    # GIVEN python3.12 with the function's code and the built layer as its whole path, and
    # the environment Lambda gives the function deployed with Tracing=true
    env = {
        "PATH": "/usr/bin:/bin",
        "LAMBDA_TASK_ROOT": str(ROOT),
        "AWS_LAMBDA_FUNCTION_NAME": "spillway-router",
        "AWS_EXECUTION_ENV": "AWS_Lambda_python3.12",
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "_X_AMZN_TRACE_ID": f"Root={TRACE_ROOT};Parent=53995c3f42cd8ad8;Sampled=1",
        "AWS_XRAY_DAEMON_ADDRESS": "127.0.0.1:2000",
        f"{prefix}_TRACING": "true",
        "ROUTER_GPU_URL": "",
        "ROUTER_LOG_LEVEL": "WARNING",
    }
    event = (
        ROOT / "events" / "router" / "live-rest-v1.json"
        if prefix == "ROUTER"
        else _anonymous_status(tmp_path)
    )
    # WHEN the handler module is imported (the cold start) and serves an event
    done = subprocess.run(
        [str(python312()), "-I", "-S", "-c", _PROBE, str(ROOT), str(layer), str(event), module],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    # THEN it starts, with the X-Ray tracer of the layer on and wrapping the handler
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["xray_from"].startswith(str(layer))
    assert (result["tracing"], result["tracer_disabled"], result["handler_traced"]) == (
        True,
        False,
        True,
    )
    assert result["status"] == status
