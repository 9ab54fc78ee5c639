"""Repository control on the GPU service needs a token whenever it listens beyond loopback."""

from __future__ import annotations

from typing import Any

import pytest

from gpu_service.dataplane import DataPlane
from gpu_service.http import GpuServiceApp
from gpu_service.settings import GpuSettings
from spillway.protocol.errors import UnauthorizedError


def _app(**settings: Any) -> GpuServiceApp:
    plane = DataPlane(registry=None, settings=GpuSettings(**settings))  # type: ignore[arg-type]
    return GpuServiceApp(plane)


def _headers(authorization: str | None = None) -> list[tuple[bytes, bytes]]:
    return [] if authorization is None else [(b"authorization", authorization.encode())]


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_loopback_without_a_token_allows_control(host: str) -> None:
    # GIVEN a service on loopback without a token WHEN a control request comes THEN allowed
    _app(host=host)._authorize(_headers())


def test_beyond_loopback_without_a_token_refuses_control() -> None:
    # GIVEN a service listening on every interface, no token configured
    app = _app(host="0.0.0.0")
    # WHEN a control request comes THEN 401, saying which setting is missing
    with pytest.raises(UnauthorizedError, match="GPU_ADMIN_TOKEN"):
        app._authorize(_headers("Bearer anything"))


def test_a_token_is_checked_wherever_the_service_listens() -> None:
    # GIVEN a token configured on a service beyond loopback
    app = _app(host="0.0.0.0", admin_token="s3cret-for-test")  # noqa: S106
    # WHEN the right and a wrong token are presented THEN only the right one passes
    app._authorize(_headers("Bearer s3cret-for-test"))
    with pytest.raises(UnauthorizedError):
        app._authorize(_headers("Bearer wrong"))
    with pytest.raises(UnauthorizedError):
        app._authorize(_headers())
