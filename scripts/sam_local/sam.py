"""The SAM CLI with ``--docker-network host`` working: run as ``python sam.py local invoke ...``
with the SAM CLI's own interpreter (.venv-sam).

SAM CLI 1.170 accepts ``--docker-network host`` but never asks Docker for the host's
network: the function's container stays on the default bridge, where 127.0.0.1 is the
container itself and the local stack cannot be reached (aws/aws-sam-cli#4236). This sets
the container's network mode to ``host`` and, since the emulator then shares the host's
ports, moves its two listeners (the invoke endpoint SAM calls, and the runtime API the
function polls) to free ports on 127.0.0.1.
"""

from __future__ import annotations

import socket
import sys
from typing import Any

from docker.models.containers import ContainerCollection
from samcli.cli.main import cli
from samcli.local.docker.container import Container

HOST = "host"
_create = Container.create
_create_container = ContainerCollection.create


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _create_on_host_network(self: Any, *args: Any, **kwargs: Any) -> Any:
    if self.network_id == HOST:
        self._container_opts = {**(self._container_opts or {}), "network_mode": HOST}
        emulator, *rest = self._entrypoint
        self._entrypoint = [
            emulator,
            f"--runtime-interface-emulator-address=127.0.0.1:{self.rapid_port_host}",
            f"--runtime-api-address=127.0.0.1:{_free_port()}",
            *rest,
        ]
    return _create(self, *args, **kwargs)


def _create_container_without_ports(self: Any, image: str, *args: Any, **kwargs: Any) -> Any:
    if kwargs.get("network_mode") == HOST:
        kwargs.pop("ports", None)  # published ports mean nothing on the host's network
    return _create_container(self, image, *args, **kwargs)


Container.create = _create_on_host_network
ContainerCollection.create = _create_container_without_ports

if __name__ == "__main__":
    sys.exit(cli(prog_name="sam"))
