"""What the router really emits, what a CloudWatch query selects, and when an alarm fires.

Alarms and dashboard series on the router's metrics are only right if their namespace,
metric name, dimension set and dimension values are those of the EMF lines the router
writes. Tests take those from the router's own accounting code (``route_metrics``)
rather than repeating names, read Metrics Insights queries and dashboard ``SEARCH``
expressions back into the same terms, and evaluate an alarm over datapoints as
CloudWatch does (``TreatMissingData`` included).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from spillway.policy.accounting import RouteRecord, route_metrics


@dataclass(frozen=True)
class Emitted:
    """One EMF line: its namespace, dimension set (with values) and metric values."""

    namespace: str
    dimensions: dict[str, str]
    metrics: dict[str, float]


def emitted(**record: Any) -> Emitted:
    """The EMF line the router writes for a request described by ``record``."""
    fields: dict[str, Any] = {"rule": "default", "model": "digits", "status": 200,
                              "latency_ms": 12.0, "cost_usd": 0.0001}  # fmt: skip
    document = route_metrics(RouteRecord(**{**fields, **record}))
    directive = document["_aws"]["CloudWatchMetrics"]  # type: ignore[index]
    assert len(directive) == 1
    assert len(directive[0]["Dimensions"]) == 1
    names = [metric["Name"] for metric in directive[0]["Metrics"]]
    return Emitted(
        namespace=directive[0]["Namespace"],
        dimensions={name: str(document[name]) for name in directive[0]["Dimensions"][0]},
        metrics={name: _total(document[name]) for name in names},
    )


def _total(value: object) -> float:
    """An EMF metric value: a number, or a list of samples (CloudWatch counts each)."""
    samples = value if isinstance(value, list) else [value]
    return float(sum(samples))


@dataclass(frozen=True)
class Query:
    """A ``SELECT FUNC(metric) FROM SCHEMA(namespace, dims…) WHERE d = 'v' AND …``."""

    function: str
    metric: str
    namespace: str
    schema: frozenset[str]
    where: dict[str, str]


_SELECT = re.compile(
    r"""\s*SELECT\s+(?P<function>\w+)\((?P<metric>\w+)\)\s+
    FROM\s+SCHEMA\(\s*"?(?P<namespace>[^",]+)"?\s*,(?P<schema>[^)]*)\)
    (?:\s+WHERE\s+(?P<where>.+?))?\s*""",
    re.IGNORECASE | re.VERBOSE | re.DOTALL,
)
_CONDITION = re.compile(r"^\s*(\w+)\s*=\s*'([^']*)'\s*$")


def parse_query(text: str) -> Query:
    """A Metrics Insights query of the one form alarms here use (equality filters only)."""
    match = _SELECT.fullmatch(text)
    assert match, f"not a Metrics Insights query of the expected form: {text!r}"
    where: dict[str, str] = {}
    if match["where"]:
        for condition in re.split(r"\s+AND\s+", match["where"], flags=re.IGNORECASE):
            term = _CONDITION.match(condition)
            assert term, f"unsupported condition {condition!r}"
            where[term.group(1)] = term.group(2)
    return Query(
        function=match["function"].upper(),
        metric=match["metric"],
        namespace=match["namespace"].strip(),
        schema=frozenset(d.strip().strip('"') for d in match["schema"].split(",")),
        where=where,
    )


def selects(query: Query, line: Emitted) -> bool:
    """Whether the query's series includes this EMF line's metric value."""
    return (
        query.namespace == line.namespace
        and query.metric in line.metrics
        and query.schema == frozenset(line.dimensions)
        and all(line.dimensions.get(name) == value for name, value in query.where.items())
    )


_SEARCH = re.compile(r"SEARCH\(\s*'\{(?P<schema>[^}]*)\}(?P<terms>[^']*)'\s*,\s*'(?P<stat>\w+)'")
_TERM = re.compile(r'(\w+)\s*=\s*"([^"]*)"')


def parse_searches(expression: str) -> list[Query]:
    """Every ``SEARCH('{Namespace,dims…} MetricName="M" dim="v"', 'Stat', period)`` in a
    dashboard expression."""
    queries = []
    for match in _SEARCH.finditer(expression):
        namespace, *schema = (part.strip() for part in match["schema"].split(","))
        terms = dict(_TERM.findall(match["terms"]))
        queries.append(
            Query(
                function=match["stat"].upper(),
                metric=terms.pop("MetricName"),
                namespace=namespace,
                schema=frozenset(schema),
                where=terms,
            )
        )
    return queries


COMPARE = {
    "GreaterThanThreshold": operator.gt,
    "GreaterThanOrEqualToThreshold": operator.ge,
    "LessThanThreshold": operator.lt,
    "LessThanOrEqualToThreshold": operator.le,
}


def in_alarm(alarm: dict[str, Any], datapoints: Sequence[float | None]) -> bool:
    """Whether ``alarm`` is in ALARM after its last ``EvaluationPeriods`` datapoints
    (``None``: no data, treated as ``TreatMissingData`` says)."""
    periods = int(alarm["EvaluationPeriods"])
    window = list(datapoints)[-periods:]
    treat = alarm.get("TreatMissingData", "missing")
    compare, threshold = COMPARE[alarm["ComparisonOperator"]], float(alarm["Threshold"])
    breaching = 0
    for point in window:
        if point is None:
            breaching += treat == "breaching"
        else:
            breaching += bool(compare(point, threshold))
    return breaching >= int(alarm.get("DatapointsToAlarm", periods))
