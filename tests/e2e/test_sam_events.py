"""Every event in events/ through its function's handler, without Docker: a plain Python
process per function with exactly the environment ``sam local invoke`` gives it (the SAM
CLI computes it from template.yaml and the env-vars file ``spillway up`` writes), against
the local stack. The fast form of test_sam_local.py; the same answers are expected."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spillway.aws.clients import aws_client
from spillway_cli.local.stack import LocalStack
from tests.e2e.sam_local import (
    EVENT_FUNCTIONS,
    EXPECTED,
    ROOT,
    Answer,
    event_names,
    facts,
    load_models,
    sam_environments,
    seed_jobs_input,
)

# Calls the handler SAM names (AWS_LAMBDA_FUNCTION_HANDLER) with each event file in one
# execution environment (a warm container's); one JSON answer per line of the file named
# first (stdout is the function's log).
_RUNNER = """
import importlib, json, os, sys
from tests.lambda_context import LambdaContext
module, name = os.environ["AWS_LAMBDA_FUNCTION_HANDLER"].rsplit(".", 1)
handler = getattr(importlib.import_module(module), name)
with open(sys.argv[1], "w") as out:
    for path in sys.argv[2:]:
        with open(path) as event:
            out.write(json.dumps(handler(json.load(event), LambdaContext())) + "\\n")
"""


@pytest.fixture(scope="module")
def answers(
    stack: LocalStack, models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Answer]:
    """Each event's answer, the functions run in the environment SAM gives them."""
    environments = sam_environments(stack.sam_env_path)
    seed_jobs_input(models_dir, aws_client("s3"))
    load_models(stack.url("gpu"))
    found: dict[str, Answer] = {}
    for function in EVENT_FUNCTIONS:
        names = event_names(function)
        out = tmp_path_factory.mktemp("answers") / f"{function}.jsonl"
        # The process gets SAM's variables and nothing else of ours, but the interpreter's
        # path: the code and its packages (the container's /var/task and layer).
        env = {
            **environments[function],
            "PATH": os.environ["PATH"],
            "PYTHONPATH": str(ROOT),
            "LAMBDA_TASK_ROOT": str(ROOT),
        }
        done = subprocess.run(
            [sys.executable, "-c", _RUNNER, out, *(ROOT / "events" / n for n in names)],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        assert done.returncode == 0, f"{function}: {done.stderr[-3000:]}"
        lines = out.read_text().splitlines()
        assert len(lines) == len(names), done.stderr[-3000:]
        found.update({n: Answer(json.loads(line)) for n, line in zip(names, lines, strict=True)})
    return found


def test_every_event_has_an_expectation() -> None:
    names = {n for function in EVENT_FUNCTIONS for n in event_names(function)}
    assert names == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_event_through_its_handler_with_the_sam_environment(
    answers: dict[str, Answer], models_dir: Path, name: str
) -> None:
    # GIVEN the event, WHEN its function serves it with the environment SAM gives it
    # THEN the answer is the expected one
    EXPECTED[name].verify(answers[name], facts(models_dir))
