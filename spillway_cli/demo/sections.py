"""The demo's sections in the order they run: the one list their numbers come from.

A section's number is its place in ``SECTIONS``; ``run_sections`` prints it in the
section's heading and names the section's checks with it. The section modules print only
what they saw, under that heading, so that no number is written twice (the frame-stream
section once printed its number for each set of frames) or by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from spillway_cli.console import Check, Checks
from spillway_cli.demo.async_requests import scenario_async
from spillway_cli.demo.batch import scenario_batch
from spillway_cli.demo.canary import CanaryReport, scenario_canary
from spillway_cli.demo.client import Client
from spillway_cli.demo.faults import scenario_hot_swap, scenario_kill_gpu
from spillway_cli.demo.pipelines import scenario_topics
from spillway_cli.demo.serving import scenario_digits, scenario_minilm, scenario_serverless
from spillway_cli.demo.streams import scenario_frame_streams
from spillway_cli.local.stack import LocalStack

ASYNC_LIMIT_S = 300.0
"""How long the async section's requests may take to finish."""


@dataclass
class Demo:
    """What every section is given, and what one leaves for the closing report."""

    stack: LocalStack
    client: Client
    models: Path
    out: Path
    checks: Checks
    say: Callable[[str], None]
    canary: CanaryReport | None = None
    """The canary section's report (its by-design failures are reported apart)."""


@dataclass(frozen=True)
class Section:
    """One section of the demo (its number: its place in ``SECTIONS``)."""

    name: str
    """What its checks are recorded under, after its number (``7. canary ...``)."""
    heading: str
    """The line that opens it, after its number."""
    run: Callable[[Demo, str], list[Check]]
    """Runs it, given the demo and its numbered name; the checks to record. A check the
    rest of the run depends on is recorded by the section itself (``Checks.require``)."""
    recorded: bool = False
    """Its requests go through the recording client (the summary per backend's)."""


def _canary(demo: Demo, _: str) -> list[Check]:
    demo.canary = scenario_canary(demo.stack, demo.models, demo.say)
    return demo.canary.checks()


def _async(demo: Demo, _: str) -> list[Check]:
    headers = dict(demo.stack.router_headers)
    ports = demo.stack.ports
    report = scenario_async(ports.router, headers, demo.models, demo.say, timeout_s=ASYNC_LIMIT_S)
    return report.checks()


def _topics(demo: Demo, _: str) -> list[Check]:
    headers = dict(demo.stack.router_headers)
    return scenario_topics(demo.stack.ports.router, headers, demo.say).checks()


CANARY = Section("canary (fails on purpose)", "a canary that fails on purpose", _canary)

SECTIONS: tuple[Section, ...] = (
    Section(
        "digits",
        "digits via the router",
        lambda demo, _: scenario_digits(demo.client, demo.models),
        recorded=True,
    ),
    Section(
        "minilm",
        "minilm via the router",
        lambda demo, _: scenario_minilm(demo.client),
        recorded=True,
    ),
    Section(
        "serverless",
        "a serverless, low-priority request",
        lambda demo, _: scenario_serverless(demo.client),
        recorded=True,
    ),
    Section(
        "batch job",
        "an offline batch job over s3://spillway-data/inputs/digits/ (3 files, 300 records)",
        lambda demo, name: scenario_batch(demo.stack, demo.models, demo.out, demo.checks, name),
    ),
    Section(
        "GPU service killed",
        "the GPU service SIGKILLed under load",
        lambda demo, name: scenario_kill_gpu(demo.client, demo.stack, demo.checks, name),
        recorded=True,
    ),
    Section(
        "hot swap",
        "hot swap of digits under load",
        lambda demo, _: scenario_hot_swap(demo.client, demo.stack, demo.models),
        recorded=True,
    ),
    CANARY,
    Section("async", "async inference", _async),
    Section(
        "topics", "topics through the router (the topics pipeline: minilm -> topics-head)", _topics
    ),
    Section(
        "frame streams",
        "frame streams through the WebSocket API and gRPC streams",
        lambda demo, _: scenario_frame_streams(demo.stack, demo.models),
    ),
)


def number(section: Section, sections: Sequence[Section] = SECTIONS) -> int:
    """The section's number: its place in ``sections``, from 1."""
    return sections.index(section) + 1


def recorded(sections: Sequence[Section] = SECTIONS) -> str:
    """The sections the summary per backend covers: ``sections 1, 2, 3, 5, 6``."""
    numbers = [str(n) for n, section in enumerate(sections, 1) if section.recorded]
    return f"sections {', '.join(numbers)}"


def run_sections(demo: Demo, sections: Sequence[Section] = SECTIONS) -> None:
    """Every section in order: its numbered heading, then it, then its checks."""
    for at, section in enumerate(sections, 1):
        demo.say(f"\n{at}. {section.heading}")
        name = f"{at}. {section.name}"
        demo.checks.record(name, section.run(demo, name))
