"""What every event in events/ must produce when its function serves it against the local
stack, and the pieces both tiers need: the environment ``sam local invoke`` gives a
function (computed by the SAM CLI itself), the jobs input the events name, and one parser
for the functions' answers.

``test_sam_events.py`` runs each event through its handler in a plain process with that
environment; ``test_sam_local.py`` runs it with ``sam local invoke`` in a container. Both
hold the answers to ``EXPECTED``.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from spillway.state.table import scope
from spillway_cli.local.names import DATA_BUCKET
from tests.integration.test_jobs_support import EXAMPLE_API_KEY_ID

ROOT = Path(__file__).resolve().parents[2]
EVENTS = ROOT / "events"
TEMPLATE = ROOT / "template.yaml"
SAM_VENV = ROOT / os.environ.get("SAM_VENV", ".venv-sam")
# template.yaml's functions and their folders of events
FUNCTIONS = {"RouterFunction": "router", "CpuInferFunction": "cpu_infer", "JobsFunction": "jobs"}
# The WebSocket function's events run through its handler without Docker only
# (test_sam_events.py): its code is the router's, in the same zip and layer.
EVENT_FUNCTIONS = {**FUNCTIONS, "WebSocketFunction": "websocket"}
# Events that read what an earlier one wrote, in the order they run: the session the PUT
# stored, the job submit.json started.
CHAINS = (
    ("router/session-put-rest-v1.json", "router/session-get-rest-v1.json"),
    ("jobs/submit.json", "jobs/status-of-submit.json", "jobs/status.json", "jobs/nightly.json"),
    ("websocket/connect.json", "websocket/message-text.json", "websocket/disconnect.json"),
)
# uuid5 of submit.json's caller's scope and Idempotency-Key
SUBMITTED_JOB = "9a510cb6-3ea2-59b9-a4b5-788e356ddd65"
NIGHTLY_DAY = "2024-06-02"  # nightly.json's time


def event_names(function: str) -> list[str]:
    """The events of a function, as ``<folder>/<file>``, each chain in its order."""
    folder = EVENT_FUNCTIONS[function]
    names = sorted(f"{folder}/{path.name}" for path in (EVENTS / folder).glob("*.json"))
    for chain in CHAINS:
        slots = [i for i, name in enumerate(names) if name in chain]
        for slot, name in zip(slots, [n for n in chain if n in names], strict=True):
            names[slot] = name
    return names


def sam_process_env() -> dict[str, str]:
    """A clean environment for the SAM CLI: SAM lets the shell's value of a template
    variable win over the template, so nothing of the caller's shell may leak in; no AWS
    profile either (SAM then passes its placeholder credentials, which moto accepts)."""
    keep = ("PATH", "HOME", "LANG", "DOCKER_HOST", "TMPDIR")
    return {
        **{name: os.environ[name] for name in keep if name in os.environ},
        "SAM_CLI_TELEMETRY": "0",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }


def sam_environments(env_vars: Path, template: Path = TEMPLATE) -> dict[str, dict[str, str]]:
    """Each function's environment under ``sam local invoke --env-vars env_vars``."""
    python = SAM_VENV / "bin" / "python"
    if not python.exists():
        raise AssertionError(f"no SAM CLI at {SAM_VENV} (make check-infra installs it)")
    done = subprocess.run(
        [str(python), str(ROOT / "scripts/sam_local/environment.py"), str(template), str(env_vars)],
        env=sam_process_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, dict[str, str]] = json.loads(done.stdout)
    return result


def load_models(gpu_url: str, models: tuple[str, ...] = ("digits", "minilm")) -> None:
    """Load the events' models in the GPU service first: what is measured here is the
    events' path, not a model's first load racing a request's deadline on a busy machine."""
    for model in models:
        request = urllib.request.Request(
            f"{gpu_url}/v2/repository/models/{model}/load", data=b"", method="POST"
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            assert response.status == 200, model


def seed_jobs_input(models_dir: Path, s3: Any) -> None:
    """The inputs submit.json and nightly.json name, in the stack's S3: two JSON Lines
    files of digits images under each prefix."""
    images = np.load(models_dir / "digits" / "samples" / "images.npy").astype(np.float32)
    area = f"tenants/{scope(EXAMPLE_API_KEY_ID)}/"  # submit.json's caller's own area
    for prefix in (f"{area}digits/in/", "nightly/input/"):
        for f in range(2):
            lines = [
                json.dumps({"id": f"{f}-{i}", "data": {"image": images[f * 5 + i].tolist()}})
                for i in range(5)
            ]
            s3.put_object(Bucket=DATA_BUCKET, Key=f"{prefix}{f}.jsonl", Body="\n".join(lines))


@dataclass(frozen=True)
class Answer:
    """A function's answer in API Gateway's proxy-response shape (also what the CPU
    fallback answers a direct invoke with), or a plain result (the scheduled event)."""

    raw: dict[str, Any]

    @property
    def status(self) -> int | None:
        status = self.raw.get("statusCode")
        return None if status is None else int(status)

    @property
    def headers(self) -> dict[str, str]:
        multi = self.raw.get("multiValueHeaders") or {}
        single = self.raw.get("headers") or {}
        return {k.lower(): v[0] for k, v in multi.items()} | {
            k.lower(): v for k, v in single.items()
        }

    @property
    def body(self) -> Any:
        raw = self.raw.get("body") or ""
        data = base64.b64decode(raw) if self.raw.get("isBase64Encoded") else raw.encode()
        if self.headers.get("content-type", "").startswith("application/octet-stream"):
            size = int(self.headers.get("inference-header-content-length", len(data)))
            data = data[:size]
        return json.loads(data) if data else None


Check = Callable[[Answer, "Facts"], None]


@dataclass(frozen=True)
class Facts:
    """What an answer is held against."""

    label: int  # the digits model's label of the events' image (samples/labels.npy[0])


def _label(answer: Answer, facts: Facts) -> None:
    assert answer.body["outputs"] == [
        {"name": "label", "datatype": "INT64", "shape": [1, 1], "data": [facts.label]}
    ], answer.body


def _routed(backend: str, rule: str, then: Check | None = _label) -> Check:
    def check(answer: Answer, facts: Facts) -> None:
        headers = answer.headers
        assert (headers["x-spillway-backend"], headers["x-spillway-rule"]) == (backend, rule)
        if then is not None:
            then(answer, facts)

    return check


def _body(expected: Mapping[str, Any]) -> Check:
    def check(answer: Answer, facts: Facts) -> None:
        assert {k: answer.body.get(k) for k in expected} == dict(expected), answer.body

    return check


def _embedding(answer: Answer, facts: Facts) -> None:
    (output,) = answer.body["outputs"]
    assert (output["name"], output["shape"]) == ("embedding", [1, 384])
    assert abs(float(np.linalg.norm(output["data"])) - 1.0) < 1e-3  # minilm normalises


def _embeddings(answer: Answer, facts: Facts) -> None:
    # The OpenAI-compatible door: one minilm vector, the 7 tokens of "a calm post about
    # gardening" ([CLS] and [SEP] counted), from the repository on the stack's S3.
    (item,) = answer.body["data"]
    assert (item["object"], item["index"], len(item["embedding"])) == ("embedding", 0, 384)
    assert abs(float(np.linalg.norm(item["embedding"])) - 1.0) < 1e-3
    assert answer.body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}


def _minilm_listed(answer: Answer, facts: Facts) -> None:
    listed = {model["id"]: model["owned_by"] for model in answer.body["data"]}
    assert listed.get("minilm") == "spillway", answer.body


def _mode_unavailable(answer: Answer, facts: Facts) -> None:
    # Locally the Lambda endpoint serves the CPU fallback alone (spillway_cli/local/sam_env.py).
    assert answer.body["code"] == "mode_unavailable", answer.body
    assert answer.headers["x-spillway-rule"] == "batch-requested"


def _submitted(answer: Answer, facts: Facts) -> None:
    job = answer.body["job"]
    assert job["job_id"] == SUBMITTED_JOB
    assert (job["model"], job["shards_total"]) == ("digits", 2)
    assert answer.headers["location"] == f"/v1/jobs/{SUBMITTED_JOB}"


def _nightly(answer: Answer, facts: Facts) -> None:
    job = answer.raw["job"]
    assert (job["model"], job["shards_total"]) == ("digits", 2)
    assert job["input"] == f"s3://{DATA_BUCKET}/nightly/input/"
    assert job["output"] == f"s3://{DATA_BUCKET}/nightly/output/{NIGHTLY_DAY}/"


@dataclass(frozen=True)
class Expected:
    """An event's status (None: not an HTTP answer) and what else must hold."""

    status: int | None
    check: Check | None = None

    def verify(self, answer: Answer, facts: Facts) -> None:
        assert answer.status == self.status, answer.raw
        if self.check is not None:
            self.check(answer, facts)


_DIGITS = _body({"name": "digits"})
EXPECTED: dict[str, Expected] = {
    "router/infer-rest-v1.json": Expected(200, _routed("gpu", "default")),
    "router/infer-binary-rest-v1.json": Expected(200, _routed("gpu", "default")),
    "router/infer-text-rest-v1.json": Expected(200, _routed("gpu", "default", _embedding)),
    "router/infer-http-v2.json": Expected(200, _routed("gpu", "default")),
    "router/infer-http-v2-stage.json": Expected(200, _routed("gpu", "realtime")),
    "router/serverless-rest-v1.json": Expected(200, _routed("cpu", "serverless-requested")),
    "router/batch-rest-v1.json": Expected(400, _mode_unavailable),
    "router/batch-http-v2.json": Expected(400, _mode_unavailable),
    "router/metadata-rest-v1.json": Expected(200, _routed("gpu", "default", _DIGITS)),
    "router/metadata-http-v2.json": Expected(200, _routed("gpu", "default", _DIGITS)),
    "router/model-ready-rest-v1.json": Expected(200, _routed("gpu", "default", None)),
    "router/ready-rest-v1.json": Expected(200, _body({"ready": True})),
    "router/live-rest-v1.json": Expected(200, _body({"live": True})),
    "router/server-rest-v1.json": Expected(200, _body({"name": "spillway-router"})),
    # No such async request (and none can be made where async mode is not offered).
    "router/result-rest-v1.json": Expected(404),
    "router/session-put-rest-v1.json": Expected(204),
    "router/session-get-rest-v1.json": Expected(200, _body({"topic": "gardening", "turns": 1})),
    "router/embeddings-rest-v1.json": Expected(200, _routed("gpu", "default", _embeddings)),
    "router/models-rest-v1.json": Expected(200, _minilm_listed),
    "router/model-rest-v1.json": Expected(200, _body({"id": "minilm", "owned_by": "spillway"})),
    "cpu_infer/infer-direct.json": Expected(200, _label),
    "cpu_infer/infer-direct-binary.json": Expected(200, _label),
    "cpu_infer/infer-rest-v1.json": Expected(200, _label),
    "cpu_infer/infer-http-v2.json": Expected(200, _label),
    "cpu_infer/metadata-direct.json": Expected(200, _DIGITS),
    "jobs/submit.json": Expected(202, _submitted),
    "jobs/status-of-submit.json": Expected(200, _body({"job_id": SUBMITTED_JOB})),
    "jobs/status.json": Expected(404, _body({"code": "job_not_found"})),
    "jobs/nightly.json": Expected(None, _nightly),
    # The connection's API key is vouched for; the frame's answer is pushed to the local
    # gateway, which has no such connection (410): its state is dropped, the event is 200.
    "websocket/connect.json": Expected(200),
    "websocket/message-text.json": Expected(200),
    "websocket/disconnect.json": Expected(200),
}


def under_docker(name: str) -> bool:
    """Whether ``sam local invoke`` runs the event's function in test_sam_local.py."""
    return name.split("/", 1)[0] in FUNCTIONS.values()


def facts(models_dir: Path) -> Facts:
    """The reference values of the events' inputs."""
    return Facts(label=int(np.load(models_dir / "digits" / "samples" / "labels.npy")[0]))
