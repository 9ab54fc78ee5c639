"""One local stack per folder: a second stack in the same folder finds the first one
(its pid and URLs) and starts nothing; another folder's stack is named by the ports it
holds; a stack env file of another running stack is never written over or removed; and
``spillway up`` says which router runtime ``auto`` picks, and why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spillway_cli.local import serverless_offline, stackenv
from spillway_cli.local.running import Claim, StackRunning, holders, running_in


def _ended_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(done.stdout)


@pytest.fixture
def registry(tmp_path: Path) -> Path:
    return tmp_path / "registry"


def test_a_second_stack_in_a_folder_finds_the_first_and_takes_nothing(
    tmp_path: Path, registry: Path
) -> None:
    # GIVEN a stack holding its folder, its ports and URLs published
    folder, env = tmp_path / "a" / "out" / "stack", tmp_path / "a" / "out" / "stack" / "env.json"
    first = Claim(folder, env, registry)
    first.acquire()
    first.publish(state="up", ports={"router": 18080}, urls={"router": "http://127.0.0.1:18080"})
    try:
        # WHEN a second stack probes the folder, then tries to take it
        found = running_in(folder, env)
        second = Claim(folder, env, registry)
        with pytest.raises(StackRunning) as refused:
            second.acquire()
    finally:
        first.release()
    # THEN both name the first stack: its pid, state and URLs
    assert found is not None
    assert found.record is not None
    assert (found.record.pid, found.record.state) == (os.getpid(), "up")
    assert found.record.urls == {"router": "http://127.0.0.1:18080"}
    assert refused.value.record == found.record
    # AND once the first has stopped, the folder is free again
    assert running_in(folder, env) is None
    again = Claim(folder, env, registry)
    again.acquire()
    again.release()


def test_a_probe_creates_nothing_in_a_folder_without_a_stack(tmp_path: Path) -> None:
    # GIVEN a folder where no stack ever ran WHEN probed
    assert running_in(tmp_path / "out" / "stack", tmp_path / "out" / "stack" / "env.json") is None
    # THEN nothing was created there
    assert list(tmp_path.iterdir()) == []


def test_another_folders_stack_is_named_by_the_ports_it_holds(
    tmp_path: Path, registry: Path
) -> None:
    # GIVEN a running stack of another folder on two ports, and a record left by a stack
    # whose process has ended on a third
    other = Claim(tmp_path / "b", tmp_path / "b" / "env.json", registry)
    other.acquire()
    other.publish(ports={"router": 18080, "moto": 15000})
    stale = {"pid": _ended_pid(), "log_dir": "/gone", "env_path": "/gone/env.json"}
    (registry / "1-dead.json").write_text(json.dumps({**stale, "ports": {"gpu": 18000}}))
    try:
        # WHEN this folder's stack wants those ports
        found = holders({"router": 18080, "moto": 15000, "gpu": 18000}, registry)
    finally:
        other.release()
    # THEN the running stack is named for its two ports; the ended one for none, and its
    # record is gone
    assert {part: record.log_dir for part, record in found.items()} == {
        "router": str((tmp_path / "b").resolve()),
        "moto": str((tmp_path / "b").resolve()),
    }
    assert not (registry / "1-dead.json").exists()
    assert holders({"router": 18080}, registry) == {}  # released: no longer registered


def test_another_running_stacks_env_file_is_never_written_over_nor_removed(
    tmp_path: Path,
) -> None:
    # GIVEN the stack env file of a stack another live process runs
    path = stackenv.write_stack_env(tmp_path / "env.json", {"A": "theirs"}, pid=os.getppid())
    # WHEN this process would write its own there, then removes "its" file
    with pytest.raises(stackenv.StackEnvTaken, match=rf"pid {os.getppid()}"):
        stackenv.write_stack_env(path, {"A": "mine"})
    stackenv.remove_stack_env(path)
    # THEN the file is still the other stack's, and a probe of its folder names that stack
    assert stackenv.read_stack_env(path) == {"A": "theirs"}
    found = running_in(tmp_path / "logs", path)
    assert found is not None
    assert found.record is not None
    assert found.record.pid == os.getppid()


def test_auto_says_why_it_picks_the_wsgi_router(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN no Node.js on the PATH
    monkeypatch.setattr("shutil.which", lambda name: None)
    monkeypatch.setattr(serverless_offline, "SERVERLESS", tmp_path / "serverless")
    # WHEN the runtimes are chosen
    auto = serverless_offline.runtime_choice("auto")
    named = serverless_offline.runtime_choice("wsgi")
    # THEN `auto` names what serverless-offline lacks; a named runtime names the flag
    assert auto[0] == "wsgi"
    assert auto[1].startswith("auto: serverless-offline needs Node.js, the Serverless Framework")
    assert named == ("wsgi", "--router-runtime wsgi")
