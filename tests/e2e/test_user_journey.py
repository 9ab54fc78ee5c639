"""A user's first days with ``spillway up``, played in order (issue 35's table): a folder
of its own, the default router runtime, any free ports, every command a process of its
own run from that folder with none of a stack's variables set.

1. One stack per folder; the router checks API keys as API Gateway does and says which
   runtime runs it.
2. A model name reused with another signature is refused, then replaced on request,
   served by both backends at once, and rolled back; a new model added with ``--load``
   is served by both backends on its first request; an OCR page through the router
   needs no latency budget from the client.
3. A restart keeps what the stack was given, a second stack in another folder runs
   beside it without touching its files, and ``--fresh`` starts clean.

The stack starts three times in its folder and once in another; each start is checked
for several things at once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from spillway.protocol.codec import encode_request
from spillway_cli.local import stackenv
from spillway_cli.local.names import LOCAL_API_KEY
from spillway_cli.local.serverless_offline import RUNTIME_NAMES, runtime_choice
from spillway_cli.modelbuild.ocr import render_lines
from tests import graphs
from tests.e2e.user_stack import Up, call, infer_json, last_line, spillway
from tests.fakes import eventually
from tests.integration.test_ocr_pipelines import SENTENCES

pytestmark = pytest.mark.timeout(900)
KEY = {"x-api-key": LOCAL_API_KEY}
BACKENDS = {"gpu": {"x-spillway-mode": "realtime"}, "cpu": {"x-spillway-mode": "serverless"}}
"""How a caller asks the example policy for each backend (policies/example.yaml)."""
ROOMY_P99 = ("--p99-ms", "5000")  # a busy 2-core machine: see tests/integration/test_models_add.py
ROWS = [[1.0, 2.0, 3.0, 4.0], [-0.5, 0.0, 0.25, 8.0]]
CHANGE_S = 10.0
"""Generous bound on the CPU fallback's 1 s wait before it reads a changed index."""
Answer = tuple[int, dict[str, str], dict[str, Any]]


@pytest.fixture(scope="module")
def first(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """`spillway up` in a folder of its own, up."""
    up = Up(tmp_path_factory.mktemp("folder-a"), models_dir)
    try:
        yield up.started()
    finally:
        up.end()


@pytest.fixture(scope="module")
def dense_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's own model, ``scores.onnx``: ``y = x @ W``, x FP32 [batch, 4]."""
    return graphs.dense(tmp_path_factory.mktemp("own") / "scores.onnx")


def _digits(models_dir: Path) -> tuple[np.ndarray, list[int]]:
    """Four of the demo's images and ONNX Runtime's labels for them on the model file."""
    images = np.load(models_dir / "digits/samples/images.npy")[:4].astype(np.float32)
    session = ort.InferenceSession(
        str(models_dir / "digits/1/model.onnx"), providers=["CPUExecutionProvider"]
    )
    label = session.run(["label"], {session.get_inputs()[0].name: images.reshape(4, 64)})[0]
    return images, [int(x) for x in np.asarray(label).ravel()]


def _dense(path: Path) -> list[list[float]]:
    """ONNX Runtime's answer for ``ROWS`` on the file ``path`` (``tests.graphs.dense``)."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (y,) = session.run(["y"], {"x": np.array(ROWS, dtype=np.float32)})
    return np.asarray(y).tolist()  # type: ignore[no-any-return]


def _on(backend: str, router: str, model: str, inputs: dict[str, Any]) -> Answer:
    """``model`` through the router, asking the policy for ``backend``."""
    answer = infer_json(router, {**KEY, **BACKENDS[backend]}, model, [inputs])
    assert answer[0] != 200 or answer[1]["x-spillway-backend"] == backend
    return answer


def _cpu_after_a_change(router: str, model: str, inputs: dict[str, Any]) -> Answer:
    """The CPU fallback's answer once it serves a change of ``model``'s default version.
    It is a Lambda function, which no notice reaches: a request that does not fit the
    default it knows reads the index again, once its last read is
    ``CPU_INDEX_MISS_REFRESH_S`` (1 s) old; before that it is the client's 400."""
    deadline = time.monotonic() + CHANGE_S
    while (answer := _on("cpu", router, model, inputs))[0] != 200:
        assert (answer[0], answer[2]["code"]) == (400, "invalid_input"), answer
        assert time.monotonic() < deadline, f"the CPU fallback still answers {answer}"
        time.sleep(0.2)
    return answer


def _both_backends_answer_dense(
    router: str, model: str, expected: list[list[float]], version: str, *, changed: bool = False
) -> None:
    """``model`` through the router on each backend: ``expected`` from ``version``; with
    ``changed``, the CPU fallback's answer once it serves the change."""
    x = {"name": "x", "datatype": "FP32", "shape": [2, 4], "data": ROWS}
    gpu = _on("gpu", router, model, x)
    cpu = _cpu_after_a_change(router, model, x) if changed else _on("cpu", router, model, x)
    for backend, (status, headers, answer) in {"gpu": gpu, "cpu": cpu}.items():
        assert status == 200, (backend, answer)
        assert headers["x-spillway-model-version"] == version, backend
        (y,) = answer["outputs"]
        np.testing.assert_allclose(np.array(y["data"]).reshape(2, 3), expected, rtol=1e-6)


def _both_backends_answer_digits(
    router: str, models_dir: Path, version: str, *, changed: bool = False
) -> None:
    """The README's digits request through the router on each backend: the file's labels
    (``changed``: as ``_both_backends_answer_dense``)."""
    images, labels = _digits(models_dir)
    image = {"name": "image", "datatype": "FP32", "shape": [4, 8, 8], "data": images.tolist()}
    gpu = _on("gpu", router, "digits", image)
    cpu = (
        _cpu_after_a_change(router, "digits", image)
        if changed
        else _on("cpu", router, "digits", image)
    )
    for backend, (status, headers, answer) in {"gpu": gpu, "cpu": cpu}.items():
        assert status == 200, (backend, answer)
        assert headers["x-spillway-model-version"] == version, backend
        label = next(o for o in answer["outputs"] if o["name"] == "label")
        assert [int(x) for x in np.asarray(label["data"]).ravel()] == labels, backend


def _listing(folder: Path) -> dict[str, dict[str, object]]:
    listed = spillway(folder, "models", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    return {row["name"]: row for row in json.loads(listed.stdout)}


def _routed_by(up: Up, rule: str) -> bool:
    """An infer request with the local key, routed by ``rule`` (the router's metric line)."""
    image = {"name": "image", "datatype": "FP32", "shape": [1, 8, 8], "data": [8.0] * 64}
    status, _, _ = infer_json(up.env["SPILLWAY_ROUTER_URL"], KEY, "digits", [image])
    assert status == 200
    last = (up.folder / up.env["SPILLWAY_METRICS_LOG"]).read_text().splitlines()[-1]
    return bool(json.loads(last).get("rule") == rule)


def test_one_stack_per_folder_and_api_keys_on_the_default_runtime(
    first: Up, models_dir: Path, tmp_path: Path
) -> None:
    # GIVEN a running stack; THEN it said which runtime runs the router, and why
    runtime, why = runtime_choice("auto")
    assert first.wait_for("Router runtime:", 0) == (
        f"Router runtime: {RUNTIME_NAMES[runtime]} ({why}); a request without the local API "
        f"key (x-api-key: {LOCAL_API_KEY}) is refused with 403, as API Gateway refuses it."
    )
    # WHEN the router is called without the local key, with a wrong one, with it
    router = first.env["SPILLWAY_ROUTER_URL"]
    refused = [call(router, {}), call(router, {"x-api-key": "not-the-key"})]
    served, _, _ = call(router, {"x-api-key": first.env["SPILLWAY_API_KEY"]})
    # THEN API Gateway's refusal twice, then the answer
    assert [(status, body) for status, _, body in refused] == [
        (403, b'{"message":"Forbidden"}')
    ] * 2
    assert served == 200
    # WHEN the key is mapped to a premium tenant of the policy THEN its callers are that
    # tenant: routed by the premium rule (the mapping removed after)
    mapped = spillway(first.folder, "tenants", "add", LOCAL_API_KEY, "moderation-live")
    assert mapped.returncode == 0, mapped.stderr
    eventually(lambda: _routed_by(first, "premium-tenants"), "the premium rule", timeout_s=30)
    assert spillway(first.folder, "tenants", "remove", LOCAL_API_KEY).returncode == 0
    # WHEN `spillway up` runs again in the same folder
    before = first.env_file.read_text()
    again = spillway(first.folder, "up", "--models", str(models_dir), "--free-ports")
    # THEN it names the running stack and changes nothing
    assert again.returncode == 0, again.stderr
    assert f"A stack is already running in out/stack (pid {first.proc.pid}, up)" in again.stdout
    assert f"router    {router}" in again.stdout
    assert first.env_file.read_text() == before
    # WHEN another folder's `up` wants the running stack's router and moto ports
    ports = [first.env["SPILLWAY_ROUTER_URL"], first.env["AWS_ENDPOINT_URL"]]
    router_port, moto_port = (url.rsplit(":", 1)[1] for url in ports)
    flags = ["--gpu-port", "0", "--cpu-port", "0", "--jobs-port", "0", "--gpu-grpc-port", "0"]
    flags += ["--dashboard-port", "0", "--router-port", router_port, "--moto-port", moto_port]
    other = spillway(tmp_path, "up", "--models", str(models_dir), *flags)
    # THEN one line names the stack that holds them and how to choose others; nothing starts
    assert other.returncode == 2
    assert other.stderr.splitlines() == [
        f"error: ports {router_port} (router), {moto_port} (moto) are taken by the Spillway "
        f"stack of {first.folder / 'out' / 'stack'} (pid {first.proc.pid}): stop it there, or "
        "start this one on other ports: --free-ports, or --router-port N --moto-port N "
        "(0: any free)"
    ]
    assert not (tmp_path / "out").exists()


def test_a_reused_name_is_refused_replaced_and_rolled_back_and_a_new_model_served_at_once(
    first: Up, models_dir: Path, dense_file: Path
) -> None:
    router, folder = first.env["SPILLWAY_ROUTER_URL"], first.folder
    other = dense_file.with_name("other.onnx")
    other.write_bytes(dense_file.read_bytes())
    # WHEN a file with another signature is added under the demo's name
    refused = spillway(folder, "models", "add", str(other), "--name", "digits")
    # THEN it is refused, naming the differences and the flag; digits is still v1 alone
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "input 'image' FP32 [-1, 8, 8] is gone" in refused.stderr
    assert "--replace-signature" in refused.stderr
    assert "Traceback" not in refused.stderr
    row = _listing(folder)["digits"]
    assert (row["versions"], row["served"], row["kind"]) == ([1], [1], "image_classifier")
    _both_backends_answer_digits(router, models_dir, "1")
    # WHEN the user asks for the change in words, and for it to be loaded
    added = [str(other), "--name", "digits", "--replace-signature", "--load", *ROOMY_P99]
    replaced = spillway(folder, "models", "add", *added)
    # THEN the differences come first; v2 is what both backends serve, at once
    assert replaced.returncode == 0, replaced.stdout + replaced.stderr
    assert replaced.stdout.splitlines()[0] == (
        "digits: replacing the signature served (v1) with other.onnx's:"
    )
    _both_backends_answer_dense(router, "digits", _dense(other), "2", changed=True)
    # WHEN it is rolled back
    rolled = spillway(folder, "models", "rollback", "digits")
    # THEN v1 is served again by both backends, under its own configuration
    assert rolled.returncode == 0, rolled.stdout + rolled.stderr
    assert rolled.stdout.startswith("digits: served v2 -> v1")
    _both_backends_answer_digits(router, models_dir, "1", changed=True)
    row = _listing(folder)["digits"]
    assert (row["versions"], row["served"], row["kind"]) == ([1, 2], [1], "image_classifier")
    # WHEN a new model is added with --load
    scores = dense_file
    loaded = spillway(folder, "models", "add", str(scores), "--name", "scores", "--load")
    # THEN both backends serve it on its first request
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr
    _both_backends_answer_dense(router, "scores", _dense(scores), "1")
    # WHEN a page goes to the OCR pipeline through the router as binary data, with no
    # latency budget from the client
    lines = SENTENCES[2:4]
    page = np.array([render_lines(lines, size=24, min_side=720)], dtype=np.object_)
    body, length = encode_request({"image": page}, binary=True, outputs=["text"])
    for backend, asks in BACKENDS.items():
        headers = {**KEY, **asks, "inference-header-content-length": str(length)}
        status, answer_headers, raw = call(router, headers, "/v2/models/ocr/infer", body)
        # THEN each backend reads the page's lines within the pipeline's own budget
        assert status == 200, (backend, raw[:300])
        assert answer_headers["x-spillway-backend"] == backend
        assert json.loads(raw)["outputs"][0]["data"] == lines, backend


def test_a_restart_keeps_what_the_stack_was_given_beside_another_folder_and_fresh_does_not(
    first: Up, models_dir: Path, dense_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # GIVEN a tenant given to the running stack (and the models of the test before)
    tenant = spillway(first.folder, "tenants", "add", "team-key", "acme")
    assert tenant.returncode == 0, tenant.stderr
    # WHEN the stack is stopped
    said = first.stop()
    # THEN it said it was stopping and what it kept; its env file is gone
    assert "Stopping Spillway (Ctrl-C or SIGTERM)" in said
    assert "kept 2 models (2 versions), 1 tenant, " in last_line(said, "  state ")
    assert "`spillway up --fresh` starts clean" in said
    assert not first.env_file.exists()
    # WHEN it starts again in the same folder, and a stack starts in another folder
    second = Up(first.folder, models_dir)
    beside = Up(tmp_path_factory.mktemp("folder-b"), models_dir, "--router-runtime", "wsgi")
    try:
        second.started()
        beside.started()
        # THEN the first said what it restored, and the tenant and the models are there
        assert "restored 2 models (2 versions), 1 tenant, " in second.wait_for("  state ", 0)
        listed = spillway(first.folder, "tenants", "list")
        assert ["team-key", "acme"] in [line.split() for line in listed.stdout.splitlines()]
        row = _listing(first.folder)["digits"]
        assert (row["versions"], row["served"]) == ([1, 2], [1])
        router = second.env["SPILLWAY_ROUTER_URL"]
        _both_backends_answer_dense(router, "scores", _dense(dense_file), "1")
        # AND the other folder's stack has its own state: none of it
        theirs = _listing(beside.folder)
        assert "scores" not in theirs
        assert theirs["digits"]["versions"] == [1]
        assert second.env["SPILLWAY_ROUTER_URL"] != beside.env["SPILLWAY_ROUTER_URL"]
        # WHEN the other folder's stack stops
        beside.stop()
        # THEN this folder's env file is still there, and its router still answers
        assert stackenv.read_stack_env(second.env_file)["SPILLWAY_ROUTER_URL"] == router
        _both_backends_answer_digits(router, models_dir, "1")
    finally:
        beside.end()
        second.stop()
    # WHEN it starts with --fresh
    fresh = Up(first.folder, models_dir, "--fresh")
    try:
        fresh.started()
        # THEN it started clean: no tenant, no added model or version
        assert "--fresh: starting clean (moved to out/stack/state.previous)" in fresh.wait_for(
            "  state ", 0
        )
        listed = spillway(first.folder, "tenants", "list")
        assert "no identities mapped" in listed.stdout
        after = _listing(first.folder)
        assert "scores" not in after
        assert after["digits"]["versions"] == [1]
    finally:
        fresh.stop()
