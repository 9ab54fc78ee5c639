"""The stack env file: where a running ``spillway up`` stack can be reached.

``spillway up`` writes it (``out/stack/env.json`` by default; ``SPILLWAY_STACK_ENV`` names
another) once every part is up, and removes it when the stack stops: only its own file
(the pid in it is the stack's), and it never writes over the file of another stack that
runs. It holds the
variables a command needs to talk to that stack: boto3's endpoint, region and the dummy
credentials moto accepts, the tables, buckets and model repository, the services' URLs,
the router's policy, metrics log and log.
The commands that talk to AWS or the stack read it by default (``use_stack_env``): a flag
given on the command line, or a variable already in the environment, wins over it.

A file whose stack is gone (its process ended without removing it, e.g. SIGKILL) is
ignored.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import typer

from spillway_cli.local.procs import alive

STACK_ENV = Path("out/stack/env.json")
PATH_VARIABLE = "SPILLWAY_STACK_ENV"
REGISTRY = Path(tempfile.gettempdir()) / f"spillway-stacks-{os.getuid()}"
"""This user's running stacks, one record each (``spillway_cli.local.running``)."""
NO_AWS = (
    "no local stack runs (no {path}) and no AWS configuration was found: "
    "start one with `spillway up`, or set AWS_REGION and credentials"
)


def stack_env_path() -> Path:
    """Where the running stack's env file is: ``SPILLWAY_STACK_ENV`` or the default."""
    return Path(os.environ.get(PATH_VARIABLE) or STACK_ENV)


def find_stack_env(registry: Path | None = None) -> Path:
    """Where a command finds the running stack's env file: ``SPILLWAY_STACK_ENV``, else
    this folder's (``out/stack/env.json``) when it is there, else that of the one
    ``spillway up`` stack of this user's that runs, wherever it was started (a command
    run from another folder); the default path when none or several run."""
    if os.environ.get(PATH_VARIABLE) or STACK_ENV.is_file():
        return stack_env_path()
    found = running_env_files(registry or REGISTRY)
    return found[0] if len(found) == 1 else STACK_ENV


def running_env_files(registry: Path) -> list[Path]:
    """The env files of this user's findable stacks that are up."""
    paths = []
    for entry in sorted(registry.glob("*.json")) if registry.is_dir() else []:
        try:
            record = json.loads(entry.read_text(encoding="utf-8"))
            pid, env_path = int(record["pid"]), Path(record["env_path"])
            findable, up = record.get("findable") is True, record.get("state") == "up"
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if findable and up and alive(pid) and env_path.is_file():
            paths.append(env_path)
    return paths


class StackEnvTaken(RuntimeError):
    """The stack env file is another running stack's."""


def write_stack_env(path: Path, values: Mapping[str, str], pid: int | None = None) -> Path:
    """Write the file for the stack run by process ``pid`` (this one by default),
    atomically: a reader never sees half of it. ``StackEnvTaken`` when the file is
    another running stack's."""
    owner = os.getpid() if pid is None else pid
    holder = stack_pid(path)
    if holder is not None and holder != owner and alive(holder):
        raise StackEnvTaken(f"{path} is the stack env file of another stack (pid {holder})")
    document = {"pid": owner, "env": dict(values)}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    partial.replace(path)
    return path


def read_stack_env(path: Path | None = None) -> dict[str, str]:
    """The running stack's variables; empty when there is no file, it cannot be read, or
    the process that wrote it has ended."""
    try:
        document = json.loads((path or find_stack_env()).read_text(encoding="utf-8"))
        pid, values = int(document["pid"]), document["env"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    if not alive(pid) or not isinstance(values, dict):
        return {}
    return {str(name): str(value) for name, value in values.items()}


def stack_pid(path: Path) -> int | None:
    """The pid a stack env file names (``None``: no file, or none readable)."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
        return int(document["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remove_stack_env(path: Path, pid: int | None = None) -> None:
    """Remove the file when process ``pid`` (this one by default) wrote it: the stack
    has stopped. Another stack's file stays."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if isinstance(document, dict) and document.get("pid") == (os.getpid() if pid is None else pid):
        path.unlink(missing_ok=True)


def use_stack_env(path: Path | None = None) -> dict[str, str]:
    """Put the running stack's variables into this process's environment, each only
    where the environment does not set it already; the ones put there."""
    added = {
        name: value for name, value in read_stack_env(path).items() if not os.environ.get(name)
    }
    os.environ.update(added)
    return added


def require_aws() -> None:
    """Exit with one line when boto3 would find no region or no credentials (no stack
    env file applied and no AWS configuration): before a client is made, so that the
    core's wrapping of the error does not hide the fix."""
    from spillway.aws.clients import has_region_and_credentials

    if not has_region_and_credentials():
        typer.echo(f"error: {NO_AWS.format(path=find_stack_env())}", err=True)
        raise typer.Exit(1)


@contextmanager
def aws_errors() -> Iterator[None]:
    """Turn "boto3 has nowhere to go" into one line and exit status 1: no region, no
    credentials, or an endpoint that does not answer (a stack that has gone)."""
    from spillway.aws.errors import EndpointConnectionError, NoCredentialsError, NoRegionError

    try:
        yield
    except (NoRegionError, NoCredentialsError):
        typer.echo(f"error: {NO_AWS.format(path=find_stack_env())}", err=True)
        raise typer.Exit(1) from None
    except EndpointConnectionError as exc:
        typer.echo(f"error: {exc} (is the stack still up?)", err=True)
        raise typer.Exit(1) from None
