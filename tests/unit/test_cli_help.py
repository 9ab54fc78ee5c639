"""Every command's help, at a terminal 80 columns wide, names each of its options whole:
no option name cut short (rich's option table once shrank `--policy-parameter` to
`--policy-paramet…`) or broken across lines."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from spillway_cli.main import app

WIDTH = 80


def _commands(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every group and command under ``command``, with the words that reach it."""
    yield path, command
    for name, sub in (getattr(command, "commands", None) or {}).items():
        yield from _commands(sub, (*path, name))


COMMANDS = dict(_commands(typer.main.get_command(app)))


def _option_names(command: Any) -> list[str]:
    """Every long name an option of ``command`` declares (``--no-…`` forms included)."""
    return [
        name
        for param in command.params
        if getattr(param, "param_type_name", "") == "option"
        for name in (*param.opts, *param.secondary_opts)
        if name.startswith("--")
    ]


def test_the_walk_reaches_the_commands_with_the_longest_option_names() -> None:
    # GIVEN the commands found by walking the app
    # THEN the groups and the commands whose long names were cut are among them
    assert {("dashboard",), ("models", "add"), ("up",), ("jobs", "submit")} <= set(COMMANDS)
    assert "--policy-parameter" in _option_names(COMMANDS[("dashboard",)])
    assert "--max-sequence-length" in _option_names(COMMANDS[("models", "add")])


@pytest.mark.parametrize("path", list(COMMANDS), ids=lambda p: " ".join(p) or "spillway")
def test_help_at_80_columns_names_every_option_whole(path: tuple[str, ...]) -> None:
    # GIVEN a command's declared option names
    names = _option_names(COMMANDS[path])
    # WHEN its help is rendered on a terminal 80 columns wide
    result = CliRunner().invoke(
        app, [*path, "--help"], env={"COLUMNS": str(WIDTH)}, terminal_width=WIDTH
    )
    # THEN it renders, fits the width, and every name appears whole (not a prefix of it)
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.output.splitlines()) <= WIDTH
    missing = [
        n for n in names if not re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", result.output)
    ]
    assert missing == []
