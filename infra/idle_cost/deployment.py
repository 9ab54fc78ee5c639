"""The deploy shapes, and what each runs at idle: its stacks and its functions.

A shape is an application form (SAM or Serverless) and the GPU tier's floor
(``MinTasks``). Its stacks are deployed offline at their default parameters
(``infra.checks.cfn_eval``), and its functions are read with what costs at idle: their
memory, the runs a month of their enabled ``rate(...)`` schedules, whether those are the
async drain check, and their provisioned concurrency.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from infra import prices
from infra.checks.cfn_eval import Exports, Stack, load_cfn

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Shape:
    """A deploy shape: the application's form and the GPU tier's floor."""

    form: str
    min_tasks: int

    @property
    def label(self) -> str:
        """The shape's column header."""
        return f"{self.form}, MinTasks={self.min_tasks}"


SHAPES = tuple(Shape(form, n) for form in ("SAM", "Serverless") for n in (1, 0))


@dataclass(frozen=True)
class Function:
    """What a function costs at idle: per-minute-or-slower schedules and warm units."""

    name: str
    memory_mb: int
    runs_per_month: float
    drain_checks: bool
    provisioned: int


@dataclass(frozen=True)
class Deployment:
    """The stacks one shape runs, and its application's functions."""

    infra: tuple[Stack, ...]
    gpu: Stack
    functions: tuple[Function, ...]

    def resources(self, kind: str) -> Iterator[tuple[Stack, dict[str, Any]]]:
        """Each included resource of ``kind`` in the infrastructure and observability."""
        for stack in self.infra:
            for logical, resource in stack.resources.items():
                if resource["Type"] == kind and stack.included(logical):
                    yield stack, resource

    def count(self, kind: str) -> int:
        """How many included resources of ``kind``."""
        return sum(1 for _ in self.resources(kind))


_RATE = re.compile(r"^rate\((\d+) (minute|minutes|hour|hours|day|days)\)$")
_PER_MONTH = {
    "minute": prices.MINUTES_PER_MONTH,
    "hour": prices.HOURS_PER_MONTH,
    "day": prices.HOURS_PER_MONTH / 24,
}


def runs_per_month(expression: str) -> float:
    """Invocations a month of a ``rate(...)`` schedule."""
    match = _RATE.match(expression)
    if match is None:  # a cron that fires at idle runs work (a job): not an idle shape
        raise ValueError(f"an enabled schedule that is not a rate: {expression}")
    count, unit = match.groups()
    return _PER_MONTH[unit.rstrip("s")] / int(count)


def _sam_functions(app: Stack) -> tuple[Function, ...]:
    functions = []
    for logical, resource in app.resources.items():
        if resource["Type"] != "AWS::Serverless::Function":
            continue
        props = app.resolve(resource["Properties"])
        runs, drains = 0.0, False
        for event in props.get("Events", {}).values():
            schedule = event["Properties"] if event["Type"] == "Schedule" else None
            if schedule is None or schedule.get("State", "ENABLED") != "ENABLED":
                continue
            runs += runs_per_month(schedule["Schedule"])
            drains = drains or "async-drain-check" in str(schedule.get("Input", ""))
        warm = props.get("ProvisionedConcurrencyConfig", {})
        functions.append(Function(logical, int(props["MemorySize"]), runs, drains,
                                  int(warm.get("ProvisionedConcurrentExecutions", 0))))  # fmt: skip
    return tuple(functions)


_PARAM = re.compile(r"^\$\{param:([A-Za-z0-9]+)(?:,\s*(.+))?\}$")


def _sls_value(value: Any, params: dict[str, Any]) -> Any:
    """A serverless.yml value that is a literal or one ``${param:...}``, resolved."""
    match = _PARAM.match(value) if isinstance(value, str) else None
    if match is None:
        return value
    name, fallback = match.groups()
    return params.get(name, yaml.safe_load(fallback) if fallback else None)


def _sls_schedules(function: dict[str, Any]) -> Iterator[tuple[Any, dict[str, Any]]]:
    """Each schedule of a function: ``schedule`` events (a rate, or a mapping with one)
    and ``eventBridge`` events with a ``schedule``."""
    for event in function.get("events", []):
        schedule, bridge = event.get("schedule"), event.get("eventBridge")
        if isinstance(schedule, str):
            yield schedule, {}
        elif isinstance(schedule, dict):
            yield schedule["rate"], schedule
        elif isinstance(bridge, dict) and "schedule" in bridge:
            yield bridge["schedule"], bridge


def _sls_functions(config: dict[str, Any]) -> tuple[Function, ...]:
    params = config["params"]["default"]
    functions = []
    for key, function in config["functions"].items():
        runs, drains = 0.0, False
        for rate, event in _sls_schedules(function):
            if not _sls_value(event.get("enabled", True), params):
                continue
            runs += runs_per_month(str(_sls_value(rate, params)))
            drains = drains or event.get("input") == {"spillway": "async-drain-check"}
        warm = _sls_value(function.get("provisionedConcurrency", 0), params) or 0
        memory = _sls_value(function.get("memorySize", config["provider"]["memorySize"]), params)
        functions.append(Function(key, int(memory), runs, drains, int(warm)))
    return tuple(functions)


@cache
def deploy(shape: Shape) -> Deployment:
    """Every stack of ``shape`` at its default parameters, deployed offline (once a run:
    the templates do not change meanwhile)."""
    exports = Exports()

    def stack(name: str, path: str, **parameters: Any) -> Stack:
        return exports.publish(Stack(name, load_cfn(ROOT / path), parameters, exports))

    network = stack("spillway-network", "infra/network.yaml")
    storage = stack("spillway-storage", "infra/storage.yaml")
    gpu = stack("spillway-gpu", "infra/ecs-gpu-service.yaml", ImageTag="idle",
                MinTasks=shape.min_tasks)  # fmt: skip
    batch = stack("spillway-batch", "infra/batch.yaml", ImageTag="idle")
    # The SAM form nests it, the Serverless form deploys it beside: the same template.
    observability = Stack("observability", load_cfn(ROOT / "infra/observability.yaml"))
    if shape.form == "SAM":
        functions = _sam_functions(Stack("spillway", load_cfn(ROOT / "template.yaml"), {}, exports))
    else:
        config = yaml.safe_load((ROOT / "serverless.yml").read_text(encoding="utf-8"))
        functions = _sls_functions(config)
    return Deployment((network, storage, gpu, batch, observability), gpu, functions)
