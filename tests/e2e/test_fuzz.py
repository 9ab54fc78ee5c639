"""Schemathesis against the OpenAPI documents of the GPU service and the router.

Every generated case must get an answer that is not a 5xx and that matches the documented
statuses, content types and schemas; negative cases (data that breaks the schema) must be
rejected with a 4xx. Operations are driven through Hypothesis directly (a fixed number of
examples each, derandomised), which bounds both the count and the time.
"""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from spillway_cli.local.stack import LocalStack

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]
EXAMPLES = {schemathesis.GenerationMode.POSITIVE: 30, schemathesis.GenerationMode.NEGATIVE: 25}


def _runner(strategy: Any, examples: int, counts: dict[str, int], label: str) -> Any:
    @given(case=strategy)
    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case: Any) -> None:
        counts[label] = counts.get(label, 0) + 1
        case.call_and_validate(checks=CHECKS, timeout=30)

    return run


def fuzz(url: str) -> dict[str, int]:
    """Run every operation of the document at ``url``; cases per operation and mode."""
    schema = schemathesis.openapi.from_url(url)
    counts: dict[str, int] = {}
    for result in schema.get_all_operations():
        operation = result.ok()  # type: ignore[union-attr]
        for mode, examples in EXAMPLES.items():
            label = f"{operation.label} [{mode.value}]"
            run = _runner(operation.as_strategy(generation_mode=mode), examples, counts, label)
            try:
                run()
            except Unsatisfiable:
                # Nothing in the operation can be made invalid (no parameters, no body).
                assert mode is schemathesis.GenerationMode.NEGATIVE
                assert counts.get(label, 0) == 0
    return counts


@pytest.mark.parametrize("part", ["gpu", "router"])
def test_api_survives_generated_requests(stack: LocalStack, part: str) -> None:
    counts = fuzz(f"{stack.url(part)}/openapi.json")
    total = sum(counts.values())
    print(f"{part}: {total} cases over {len(counts)} operation/mode pairs")
    assert total >= 500
