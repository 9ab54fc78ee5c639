"""The stack env file ``spillway up`` writes and the other commands read: a round trip,
a file left by a stack that is gone, and who wins (the environment over the file)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spillway_cli.local import stackenv
from spillway_cli.local.layout import Ports
from spillway_cli.local.names import REPOSITORY, STATE_TABLE
from spillway_cli.local.stack import LocalStack


def _ended_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(done.stdout)


def test_the_file_round_trips_while_its_stack_runs(tmp_path: Path) -> None:
    # GIVEN the variables of a stack run by this process
    values = {"AWS_ENDPOINT_URL": "http://127.0.0.1:5123", "ROUTER_STATE_TABLE": "t-1"}
    # WHEN written, then read
    path = stackenv.write_stack_env(tmp_path / "out" / "env.json", values)
    # THEN the reader gets them back, and no partial file is left beside it
    assert stackenv.read_stack_env(path) == values
    assert [p.name for p in path.parent.iterdir()] == ["env.json"]
    assert json.loads(path.read_text())["pid"] == os.getpid()


def test_a_file_whose_stack_is_gone_is_ignored_and_left_to_its_owner(tmp_path: Path) -> None:
    # GIVEN a file written by a process that has ended, and one written by this process
    stale = stackenv.write_stack_env(tmp_path / "stale.json", {"A": "1"}, pid=_ended_pid())
    mine = stackenv.write_stack_env(tmp_path / "mine.json", {"A": "2"})
    # WHEN read, and when this process removes both
    assert stackenv.read_stack_env(stale) == {}
    assert stackenv.read_stack_env(mine) == {"A": "2"}
    stackenv.remove_stack_env(stale)
    stackenv.remove_stack_env(mine)
    # THEN only its own file is removed (another stack's stays), and a missing or broken
    # file reads as no stack
    assert (stale.exists(), mine.exists()) == (True, False)
    (tmp_path / "broken.json").write_text("{not json")
    assert stackenv.read_stack_env(tmp_path / "broken.json") == {}
    assert stackenv.read_stack_env(tmp_path / "missing.json") == {}


def test_the_environment_wins_over_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN a stack's file, named by SPILLWAY_STACK_ENV, and one variable already set
    path = stackenv.write_stack_env(
        tmp_path / "env.json", {"G2_TEST_SET": "from-file", "G2_TEST_UNSET": "from-file"}
    )
    monkeypatch.setenv(stackenv.PATH_VARIABLE, str(path))
    monkeypatch.setenv("G2_TEST_SET", "from-env")
    monkeypatch.delenv("G2_TEST_UNSET", raising=False)
    # WHEN a command takes the stack's variables
    added = stackenv.use_stack_env()
    # THEN only the unset one comes from the file
    assert added == {"G2_TEST_UNSET": "from-file"}
    assert (os.environ["G2_TEST_SET"], os.environ["G2_TEST_UNSET"]) == ("from-env", "from-file")


def test_a_stack_names_what_the_commands_need(tmp_path: Path) -> None:
    # GIVEN a stack on fixed ports (not started)
    local = LocalStack(tmp_path / "models", tmp_path / "logs", Ports(5000, 8000, 8081, 8082, 8080))
    # WHEN it lists its variables
    env = local.stack_env()
    # THEN they point boto3 at moto with dummy credentials, and name the tables, the
    # repository, the services and the router's policy file (a copy in the log folder)
    assert env["AWS_ENDPOINT_URL"] == "http://127.0.0.1:5000"
    assert env["AWS_DEFAULT_REGION"] == "us-east-1"
    assert env["AWS_ACCESS_KEY_ID"] == env["AWS_SECRET_ACCESS_KEY"] == "local"
    assert env["ROUTER_STATE_TABLE"] == STATE_TABLE
    assert env["SPILLWAY_REPOSITORY"] == env["JOBS_REPOSITORY"] == REPOSITORY
    assert env["SPILLWAY_ROUTER_URL"] == "http://127.0.0.1:8080"
    assert env["SPILLWAY_GPU_URL"] == env["ROUTER_GPU_URL"] == "http://127.0.0.1:8000"
    assert env["SPILLWAY_JOBS_URL"] == "http://127.0.0.1:8082"
    assert (env["JOBS_TABLE"], env["JOBS_JOB_QUEUE"]) == ("spillway-jobs", "spillway-jobs")
    assert env["SPILLWAY_DATA_BUCKET"] == "spillway-data"
    assert env["SPILLWAY_POLICY_FILE"] == str(tmp_path / "logs" / "policy.yaml")
    assert local.router_env()["ROUTER_POLICY_FILE"] == env["SPILLWAY_POLICY_FILE"]
    assert local.stack_env_path == tmp_path / "logs" / "env.json"


def _register(registry: Path, name: str, env_path: Path, *, findable: bool) -> None:
    registry.mkdir(exist_ok=True)
    env_path.parent.mkdir(parents=True, exist_ok=True)
    env_path.write_text(json.dumps({"pid": os.getpid(), "env": {}}), encoding="utf-8")
    record = {"pid": os.getpid(), "log_dir": str(env_path.parent), "env_path": str(env_path)}
    record |= {"state": "up", "findable": findable}
    (registry / f"{name}.json").write_text(json.dumps(record), encoding="utf-8")


def test_a_command_in_another_folder_finds_the_one_spillway_up_stack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN a command run in a folder with no stack of its own, and no SPILLWAY_STACK_ENV
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(stackenv.PATH_VARIABLE, raising=False)
    registry = tmp_path / "registry"
    # WHEN no stack runs THEN the default path is named
    assert stackenv.find_stack_env(registry) == stackenv.STACK_ENV
    # WHEN a test's stack (not findable) runs THEN it is not taken for the user's
    _register(registry, "test", tmp_path / "test-stack" / "env.json", findable=False)
    assert stackenv.find_stack_env(registry) == stackenv.STACK_ENV
    # WHEN one spillway up stack runs in another folder THEN its env file is found
    mine = tmp_path / "project" / "out" / "stack" / "env.json"
    _register(registry, "mine", mine, findable=True)
    assert stackenv.find_stack_env(registry) == mine
    # WHEN a second one runs THEN neither is guessed
    _register(registry, "other", tmp_path / "other" / "env.json", findable=True)
    assert stackenv.find_stack_env(registry) == stackenv.STACK_ENV
