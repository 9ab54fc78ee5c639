"""`spillway up`'s `auto` router runtime picks only a runtime that can start."""

from __future__ import annotations

from pathlib import Path

import pytest

from spillway_cli.local import serverless_offline, stack


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Node.js and the Serverless Framework present; the artefact not (yet)."""
    framework = tmp_path / "serverless"
    framework.write_text("")
    monkeypatch.setattr(serverless_offline, "SERVERLESS", framework)
    monkeypatch.setattr("shutil.which", lambda name: f"/usr/bin/{name}")
    artefact = tmp_path / "build" / "lambda" / "app.zip"
    monkeypatch.setattr(serverless_offline, "APP_ZIP", artefact)
    monkeypatch.setattr(serverless_offline, "ROOT", tmp_path)
    return artefact


def test_auto_takes_the_wsgi_router_while_the_artefact_is_missing(installed: Path) -> None:
    assert serverless_offline.offline_missing() == ["build/lambda/app.zip"]
    assert serverless_offline.router_runtime("auto") == "wsgi"


def test_auto_takes_serverless_offline_once_everything_is_there(installed: Path) -> None:
    installed.parent.mkdir(parents=True)
    installed.write_bytes(b"PK")
    assert serverless_offline.offline_missing() == []
    assert serverless_offline.router_runtime("auto") == "serverless-offline"


def test_an_explicit_choice_is_kept(installed: Path) -> None:
    assert serverless_offline.router_runtime("serverless-offline") == "serverless-offline"


def test_serverless_offline_without_its_artefact_fails_at_once(
    installed: Path, tmp_path: Path
) -> None:
    local = stack.LocalStack(tmp_path / "models", tmp_path / "logs")
    with pytest.raises(RuntimeError, match=r"app\.zip, which is missing"):
        local._router_offline()


def test_an_auto_chosen_offline_router_that_does_not_come_up_gives_way(
    installed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never_up(self: stack.LocalStack) -> None:
        raise TimeoutError("/v2/health/live was not healthy within 60 s")

    monkeypatch.setattr(stack.LocalStack, "_router_offline", never_up)
    chosen = stack.LocalStack(tmp_path / "m", tmp_path / "l", router_runtime="serverless-offline")
    with pytest.raises(TimeoutError):
        chosen._offline_router()  # asked for by name: the failure stands
    auto = stack.LocalStack(
        tmp_path / "m", tmp_path / "l", router_runtime="serverless-offline", router_fallback=True
    )
    assert auto._offline_router() is False
