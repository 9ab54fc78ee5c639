"""What ``spillway up`` checks before it starts anything: each problem found is one line
that says how to fix it, so that a stack that cannot come up says why within seconds
instead of timing out minutes later."""

from __future__ import annotations

import errno
import socket
from collections.abc import Mapping
from pathlib import Path

RUNTIMES = ("wsgi", "serverless-offline", "auto")


def model_problems(models: Path) -> list[str]:
    """The repository must hold the demo's models (``spillway models build``)."""
    from spillway_cli.modelbuild.build import BUILDERS

    present = [name for name in BUILDERS if (models / name / "config.json").is_file()]
    if not present:
        return [f"no models in {models}/: run `spillway models build` (or make demo)"]
    missing = [name for name in BUILDERS if name not in present]
    if missing:
        flags = " ".join(f"--model {name}" for name in missing)
        return [f"{models}/ lacks {', '.join(missing)}: run `spillway models build {flags}`"]
    return []


def port_problems(ports: Mapping[str, int]) -> list[str]:
    """Each fixed port (0: any free one) must be free on 127.0.0.1; ``ports`` maps the
    part to its port, and the part names its flag (``--<part>-port``)."""
    problems = []
    for part, port in ports.items():
        if port and not port_free(port):
            flag = f"--{part.replace('_', '-')}-port"
            problems.append(f"port {port} is taken ({part}): pass {flag} N (0: any free)")
    return problems


def port_free(port: int) -> bool:
    """Whether a server could listen on ``127.0.0.1:port`` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As the servers bind: a port left in TIME_WAIT by a stopped stack is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def runtime_problems(choice: str, missing: list[str]) -> list[str]:
    """``serverless-offline`` chosen explicitly needs what ``missing`` lists (``auto``
    falls back to the WSGI router by itself)."""
    if choice not in RUNTIMES:
        return [f"--router-runtime {choice} is unknown: pass one of {', '.join(RUNTIMES)}"]
    if choice == "serverless-offline" and missing:
        return [
            f"--router-runtime serverless-offline needs {', '.join(missing)}: run "
            "`make check-infra` and `make -f infra/lambda/Makefile serverless`, "
            "or pass --router-runtime wsgi"
        ]
    return []


def problems(
    models: Path, ports: Mapping[str, int], runtime: str, offline_missing: list[str]
) -> list[str]:
    """Every problem found, one line each (empty: ``up`` may start)."""
    return [
        *runtime_problems(runtime, offline_missing),
        *model_problems(models),
        *port_problems(ports),
    ]
