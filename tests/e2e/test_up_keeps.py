"""``spillway up`` as a user runs it, in a folder of its own (the WSGI router runtime, any
free ports): one stack per folder, the deployed stack's API key check on the WSGI
runtime, and what it was given kept across a restart — but not across ``--fresh``.

The stack starts three times (first run, restart, fresh start); each start is checked
for several things at once."""

from __future__ import annotations

import http.client
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spillway.aws.clients import client
from spillway_cli.local import stackenv
from spillway_cli.local.names import LOCAL_API_KEY, MODELS_BUCKET, REGION
from tests.fakes import eventually

pytestmark = pytest.mark.timeout(900)
OWN_PREFIXES = ("AWS_", "ROUTER_", "JOBS_", "ASYNC_", "SPILLWAY_", "CPU_", "GPU_")
UP_S = 300.0
ADDED = "repository/digits/2/"


def _user_env() -> dict[str, str]:
    """A user's environment: none of a stack's variables."""
    return {k: v for k, v in os.environ.items() if not k.startswith(OWN_PREFIXES)}


def _spillway(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spillway_cli.main", *args],
        cwd=cwd,
        env=_user_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


class Up:
    """``spillway up`` running in ``folder``, its output read line by line."""

    def __init__(self, folder: Path, models: Path, *flags: str) -> None:
        argv = [sys.executable, "-m", "spillway_cli.main", "up", "--models", str(models)]
        argv += ["--free-ports", "--router-runtime", "wsgi", *flags]
        self.folder = folder
        self.proc = subprocess.Popen(
            argv,
            cwd=folder,
            env=_user_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._new: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._new.put(line.rstrip("\n"))
        self._new.put(None)

    def wait_for(self, text: str, timeout_s: float = UP_S) -> str:
        """The first line (from the start) containing ``text``; fails, with the output so
        far, when the process ends or ``timeout_s`` passes first."""
        deadline = time.monotonic() + timeout_s
        while (found := next((x for x in self.lines if text in x), None)) is None:
            try:
                line = self._new.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no {text!r} within {timeout_s} s:\n" + "\n".join(self.lines))
            if line is None:
                pytest.fail(f"`spillway up` ended before {text!r}:\n" + "\n".join(self.lines))
            self.lines.append(line)
        return found

    @property
    def env(self) -> dict[str, str]:
        return stackenv.read_stack_env(self.folder / "out" / "stack" / "env.json")

    def stop(self) -> str:
        """SIGTERM, as a service manager stops it; its whole output."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=120)
        self.wait_for("Spillway stopped.", timeout_s=10)
        return "\n".join(self.lines)


def _call(url: str, headers: dict[str, str], body: object = None) -> tuple[int, bytes]:
    """``GET /v2``, or with ``body`` an infer request on digits."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        if body is None:
            conn.request("GET", "/v2", headers=headers)
        else:
            data = json.dumps(body).encode()
            conn.request("POST", "/v2/models/digits/infer", body=data, headers=headers)
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


def _routed_by(up: Up, rule: str) -> bool:
    """An infer request with the local key, routed by ``rule`` (the router's metric line)."""
    image = {"name": "image", "datatype": "FP32", "shape": [1, 8, 8], "data": [8.0] * 64}
    status, _ = _call(
        up.env["SPILLWAY_ROUTER_URL"], {"x-api-key": LOCAL_API_KEY}, {"inputs": [image]}
    )
    assert status == 200
    last = (up.folder / up.env["SPILLWAY_METRICS_LOG"]).read_text().splitlines()[-1]
    return bool(json.loads(last).get("rule") == rule)


def _s3(env: dict[str, str]) -> Any:
    return client("s3", region=REGION, endpoint_url=env["AWS_ENDPOINT_URL"])


def _has_added_version(env: dict[str, str]) -> bool:
    listed = _s3(env).list_objects_v2(Bucket=MODELS_BUCKET, Prefix=ADDED)
    return bool(listed.get("Contents"))


def _last(said: str, start: str) -> str:
    return [line for line in said.splitlines() if line.startswith(start)][-1]


@pytest.fixture(scope="module")
def first(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """`spillway up` in a folder of its own, up."""
    up = Up(tmp_path_factory.mktemp("folder-a"), models_dir)
    try:
        up.wait_for("Ctrl-C stops everything.")
        yield up
    finally:
        if up.proc.poll() is None:
            up.proc.send_signal(signal.SIGTERM)
            up.proc.wait(timeout=120)


def test_one_stack_per_folder_and_api_keys_on_the_wsgi_runtime(
    first: Up, models_dir: Path, tmp_path: Path
) -> None:
    # GIVEN a running stack; THEN it said which runtime runs the router, and why
    assert first.wait_for("Router runtime:", 0) == (
        "Router runtime: WSGI (--router-runtime wsgi); a request without the local API key "
        f"(x-api-key: {LOCAL_API_KEY}) is refused with 403, as API Gateway refuses it."
    )
    # WHEN the router is called without the local key, with a wrong one, with it
    router = first.env["SPILLWAY_ROUTER_URL"]
    refused = [_call(router, {}), _call(router, {"x-api-key": "not-the-key"})]
    served, _ = _call(router, {"x-api-key": first.env["SPILLWAY_API_KEY"]})
    # THEN API Gateway's refusal twice, then the answer
    assert refused == [(403, b'{"message":"Forbidden"}')] * 2
    assert served == 200
    # WHEN the key is mapped to a premium tenant of the policy THEN its callers are that
    # tenant: routed by the premium rule (the mapping removed after)
    mapped = _spillway(first.folder, "tenants", "add", LOCAL_API_KEY, "moderation-live")
    assert mapped.returncode == 0, mapped.stderr
    eventually(lambda: _routed_by(first, "premium-tenants"), "the premium rule", timeout_s=30)
    assert _spillway(first.folder, "tenants", "remove", LOCAL_API_KEY).returncode == 0
    # WHEN `spillway up` runs again in the same folder
    env_file = first.folder / "out" / "stack" / "env.json"
    before = env_file.read_text()
    again = _spillway(first.folder, "up", "--models", str(models_dir), "--free-ports")
    # THEN it names the running stack and changes nothing
    assert again.returncode == 0, again.stderr
    assert f"A stack is already running in out/stack (pid {first.proc.pid}, up)" in again.stdout
    assert f"router    {router}" in again.stdout
    assert env_file.read_text() == before
    # WHEN another folder's `up` wants the running stack's router and moto ports
    ports = [first.env["SPILLWAY_ROUTER_URL"], first.env["AWS_ENDPOINT_URL"]]
    router_port, moto_port = (url.rsplit(":", 1)[1] for url in ports)
    flags = ["--gpu-port", "0", "--cpu-port", "0", "--jobs-port", "0", "--gpu-grpc-port", "0"]
    flags += ["--dashboard-port", "0", "--router-port", router_port, "--moto-port", moto_port]
    other = _spillway(tmp_path, "up", "--models", str(models_dir), *flags)
    # THEN one line names the stack that holds them and how to choose others; nothing starts
    assert other.returncode == 2
    assert other.stderr.splitlines() == [
        f"error: ports {router_port} (router), {moto_port} (moto) are taken by the Spillway "
        f"stack of {first.folder / 'out' / 'stack'} (pid {first.proc.pid}): stop it there, or "
        "start this one on other ports: --free-ports, or --router-port N --moto-port N "
        "(0: any free)"
    ]
    assert not (tmp_path / "out").exists()


def test_a_restart_keeps_what_the_stack_was_given_and_fresh_does_not(
    first: Up, models_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):  # moto's dummy ones
        monkeypatch.setenv(name, first.env[name])
    # GIVEN a tenant and a model version given to the running stack, and the env file of
    # another folder's running stack
    tenant = _spillway(first.folder, "tenants", "add", "team-key", "acme")
    assert tenant.returncode == 0, tenant.stderr
    for name in ("model.onnx", "SHA256SUMS"):  # a second version of digits
        path = models_dir / "digits" / "1" / name
        _s3(first.env).upload_file(str(path), MODELS_BUCKET, f"{ADDED}{name}")
    theirs = stackenv.write_stack_env(tmp_path / "b" / "env.json", {"A": "b"}, pid=os.getppid())
    # WHEN the stack is stopped
    said = first.stop()
    # THEN it said it was stopping and what it kept; its env file is gone, not the other's
    assert "Stopping Spillway (Ctrl-C or SIGTERM)" in said
    assert "kept 1 model (1 version), 1 tenant, " in _last(said, "  state ")
    assert "`spillway up --fresh` starts clean" in said
    assert not (first.folder / "out" / "stack" / "env.json").exists()
    assert stackenv.read_stack_env(theirs) == {"A": "b"}
    # WHEN it starts again in the same folder
    second = Up(first.folder, models_dir)
    try:
        second.wait_for("Ctrl-C stops everything.")
        # THEN it said what it restored, and the tenant and the version are there
        assert "restored 1 model (1 version), 1 tenant, " in second.wait_for("  state ", 0)
        listed = _spillway(first.folder, "tenants", "list")
        assert ["team-key", "acme"] in [line.split() for line in listed.stdout.splitlines()]
        assert _has_added_version(second.env)
    finally:
        second.stop()
    # WHEN it starts with --fresh
    fresh = Up(first.folder, models_dir, "--fresh")
    try:
        fresh.wait_for("Ctrl-C stops everything.")
        # THEN it started clean: no tenant, no added version
        assert "--fresh: starting clean (moved to out/stack/state.previous)" in fresh.wait_for(
            "  state ", 0
        )
        listed = _spillway(first.folder, "tenants", "list")
        assert "no identities mapped" in listed.stdout
        assert not _has_added_version(fresh.env)
    finally:
        fresh.stop()
