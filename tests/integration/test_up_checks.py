"""``spillway up`` refuses to start what cannot come up, and the commands that need AWS say
in one line when there is none: each run as the real command, in a subprocess."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from spillway_cli.up_cli import EXIT_CHECKS

FREE_PORTS = ["--gpu-port", "0", "--cpu-port", "0", "--jobs-port", "0", "--moto-port", "0"]
FREE_PORTS += ["--dashboard-port", "0", "--gpu-grpc-port", "0"]


def _spillway(
    args: list[str], cwd: Path, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "spillway_cli.main", *args],
        cwd=cwd,
        env=env or dict(os.environ),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done, time.monotonic() - started


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port on 127.0.0.1 that a socket of this test listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def test_up_without_models_says_so_in_one_line(tmp_path: Path) -> None:
    # GIVEN an empty model repository
    (tmp_path / "models").mkdir()
    # WHEN `spillway up` is run on it
    args = ["up", "--models", "models", "--log-dir", "stack", "--router-port", "0", *FREE_PORTS]
    done, seconds = _spillway(args, tmp_path)
    # THEN it exits non-zero within 10 s with one line naming the fix, and starts nothing
    assert done.returncode == EXIT_CHECKS, done.stderr
    assert seconds < 10
    assert done.stderr.splitlines() == [
        "error: no models in models/: run `spillway models build` (or make demo)"
    ]
    assert "Traceback" not in done.stdout + done.stderr
    assert not (tmp_path / "stack").exists()


def test_up_with_a_taken_port_names_the_port_and_its_flag(
    models_dir: Path, tmp_path: Path, taken_port: int
) -> None:
    # GIVEN built models and the router's port taken by another listener
    args = ["up", "--models", str(models_dir), "--log-dir", "stack"]
    args += ["--router-port", str(taken_port), *FREE_PORTS, "--router-runtime", "wsgi"]
    # WHEN `spillway up` is run
    done, seconds = _spillway(args, tmp_path)
    # THEN one line names the port, the part and the flag to change it
    assert done.returncode == EXIT_CHECKS, done.stderr
    assert seconds < 10
    assert done.stderr.splitlines() == [
        f"error: port {taken_port} is taken (router): pass --router-port N (0: any free)"
    ]
    assert not (tmp_path / "stack").exists()


def test_an_unknown_router_runtime_is_one_line(models_dir: Path, tmp_path: Path) -> None:
    args = ["up", "--models", str(models_dir), "--router-port", "0", *FREE_PORTS]
    done, _ = _spillway([*args, "--router-runtime", "lambda"], tmp_path)
    assert done.returncode == EXIT_CHECKS
    assert done.stderr.splitlines() == [
        "error: --router-runtime lambda is unknown: pass one of wsgi, serverless-offline, auto"
    ]


def test_no_stack_and_no_aws_configuration_is_one_line(tmp_path: Path) -> None:
    # GIVEN no running stack (no env file) and no AWS variables or config files
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "ROUTER_", "JOBS_"))}
    env |= {"AWS_CONFIG_FILE": str(tmp_path / "none"), "HOME": str(tmp_path)}
    env |= {"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}
    env["SPILLWAY_STACK_ENV"] = str(tmp_path / "env.json")
    # WHEN commands that need AWS run
    status, _ = _spillway(["models", "status", "digits", "--table", "t"], tmp_path, env)
    jobs, _ = _spillway(["jobs", "status", "0123abcd"], tmp_path, env)
    no_table, _ = _spillway(["models", "status", "digits"], tmp_path, env)
    # THEN each says so in one line, without a traceback
    expected = (
        f"error: no local stack runs (no {tmp_path / 'env.json'}) and no AWS configuration "
        "was found: start one with `spillway up`, or set AWS_REGION and credentials"
    )
    for done in (status, jobs):
        assert done.returncode == 1
        assert done.stderr.splitlines() == [expected], done.stderr
    assert no_table.returncode == 1
    assert no_table.stderr.splitlines() == [
        "error: no state table: pass --table or set ROUTER_STATE_TABLE "
        "(or start a local stack with `spillway up`)"
    ]
