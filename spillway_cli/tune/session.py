"""One ``spillway tune`` run: read the inputs, replay, search, report, write."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from pydantic import ValidationError

from spillway.policy.rules import Policy, PolicyError, parse_policy
from spillway.router.settings import RouterSettings
from spillway_cli.cost_report import markdown, summarise
from spillway_cli.plan import inputs
from spillway_cli.tune.report import dump_policy, routes_table, routing_table
from spillway_cli.tune.search import Proposal, Slo, Tried, propose
from spillway_cli.tune.simulate import Backends, Outcome, binned, replay
from spillway_cli.tune.trace import Recorded, group_requests, read_trace


@dataclass(frozen=True)
class Tuned:
    """What a run found, and its report."""

    proposal: Proposal
    report: str


class TuneError(ValueError):
    """No policy could be proposed; ``report`` says what the replay found."""

    def __init__(self, message: str, report: str) -> None:
        super().__init__(message)
        self.report = report


def load_policy(path: Path) -> Policy:
    try:
        return parse_policy(path.read_text(encoding="utf-8"), str(path))
    except (OSError, PolicyError) as exc:
        raise ValueError(str(exc)) from None


def run_tune(
    metrics: list[Path],
    policy_file: Path,
    slo_file: Path,
    out: Path,
    measured: Path | None = None,
    pricing: Path | None = None,
    prices: Path | None = None,
    gpu_tasks: int = 1,
    bin_s: float = 10.0,
    seed: int = 7,
    router: RouterSettings | None = None,
) -> Tuned:
    """Tune and write the proposal to ``out`` (when there is one to write). The replay's
    router has the deployment's settings: ``router``, else the ``ROUTER_*`` environment
    (the defaults where it sets none)."""
    policy = load_policy(policy_file)
    slo: Slo = inputs.load_model(Slo, slo_file)
    table = inputs.load_prices(pricing or inputs.ROUTER_PRICING, prices or inputs.PLAN_PRICES)
    backends = Backends(
        inputs.load_measured(measured or inputs.MEASURED),
        table.router,
        gpu_tasks,
        table.plan.batch_start_s * 1000,
        router or _router_settings(),
    )
    try:
        trace = read_trace(metrics)
    except OSError as exc:
        raise ValueError(f"cannot read the metrics: {exc}") from None
    if not trace:
        raise ValueError("the metrics hold no request lines of the router (EMF, Spillway)")
    for model in sorted({r.model or "" for r in trace}):
        backends.measured.model(model)  # every model needs measured figures
    bins = binned(group_requests(policy, trace, bin_s), policy.defaults.priority)

    def run(candidate: Policy) -> Outcome:
        return replay(candidate, bins, backends, bin_s, seed)

    recorded = run(policy)
    context = _Context(slo, trace, metrics, policy_file, backends, slo_warnings(slo, recorded))
    if not slo.holds_any(recorded.kinds):  # every policy would "keep" it: no verdict
        unsearched = Proposal(Tried(policy, recorded, (), 0, 0.0), None, 1)
        raise TuneError(
            f"no SLO applies to a route seen in the traffic (routes seen: {_seen(recorded)}): "
            "there is nothing to hold, so no policy is called the cheapest; nothing written",
            context.report(unsearched),
        )
    # The search starts from the recorded policy itself: its replay is not run twice.
    proposal = propose(policy, lambda p: recorded if p is policy else run(p), slo)
    return _verdict(proposal, context.report(proposal), out, metrics, policy_file)


def _seen(outcome: Outcome) -> str:
    return ", ".join(sorted(outcome.kinds))


def slo_warnings(slo: Slo, recorded: Outcome) -> list[str]:
    """A warning per route the SLO file names that no request of the traffic took."""
    return [
        f"Warning: the SLO file names route {name!r}, which no request took "
        f"(routes seen: {_seen(recorded)})."
        for name in slo.unmatched(recorded.kinds)
    ]


@dataclass(frozen=True)
class _Context:
    """What a report says besides the proposal."""

    slo: Slo
    trace: list[Recorded]
    metrics: list[Path]
    policy_file: Path
    backends: Backends
    warnings: list[str]

    def report(self, proposal: Proposal) -> str:
        span, count = trace_span(self.trace), len(self.trace)
        lines = [*self.warnings, *([""] if self.warnings else [])]
        lines += _report(
            proposal, self.slo, span, count, self.metrics, self.policy_file, self.backends
        )
        lines.append("Recorded (spillway cost report of the metrics):\n")
        lines.append(markdown(summarise(_lines(self.metrics))))
        return "\n".join(lines)


def _verdict(
    proposal: Proposal, report: str, out: Path, metrics: list[Path], policy_file: Path
) -> Tuned:
    """The proposal written to ``out``, or why there is none to write."""
    if proposal.best is None:
        raise TuneError("no candidate keeps every SLO: nothing written", report)
    if not proposal.changes:
        return Tuned(proposal, report + "\n\nThe recorded policy is already the cheapest.")
    note = f"Proposed by spillway tune from {', '.join(map(str, metrics))}: " + "; ".join(
        proposal.changes
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dump_policy(proposal.best.policy, note), encoding="utf-8")
    return Tuned(
        proposal,
        report + f"\n\nWrote the proposed policy to {out}. Nothing is applied: review it, then\n"
        f"  spillway policy apply {out} --file {policy_file}   (a local router)\n"
        f"  spillway policy apply {out} --parameter /spillway-<stage>/router/policy   (AWS)",
    )


def _router_settings() -> RouterSettings:
    try:
        return RouterSettings.from_env()
    except ValidationError as exc:
        raise ValueError(f"the ROUTER_* environment is not valid: {exc}") from None


def _lines(paths: list[Path]) -> list[str]:
    lines: list[str] = []
    for path in paths:
        lines += path.read_text(encoding="utf-8").splitlines()
    return lines


def trace_span(trace: list[Recorded]) -> str:
    """When the trace starts and ends, in UTC."""
    first, last = (datetime.fromtimestamp(r.at, UTC) for r in (trace[0], trace[-1]))
    return f"{first:%Y-%m-%d %H:%M} to {last:%Y-%m-%d %H:%M} UTC"


def _report(
    proposal: Proposal,
    slo: Slo,
    span: str,
    count: int,
    metrics: list[Path],
    policy_file: Path,
    backends: Backends,
) -> list[str]:
    now = proposal.recorded.outcome
    kinds = ", ".join(f"{k} {v.requests:,}" for k, v in sorted(now.kinds.items()))
    router = backends.router
    lines = [
        f"Replayed {count:,} requests ({span}) from {', '.join(map(str, metrics))} through "
        f"{policy_file}, {backends.gpu_tasks} GPU task(s); {proposal.tried} candidate policies.",
        f"Load as the router reads it: half-life {router.load_halflife_s:g} s, a reading "
        f"stale after {router.load_stale_s:g} s (ROUTER_LOAD_HALFLIFE_S, ROUTER_LOAD_STALE_S).",
        f"Routes (kinds of request): {kinds}.",
        "",
    ]
    if proposal.recorded.breaches:
        lines.append(
            f"The recorded policy breaks the SLO of: {', '.join(proposal.recorded.breaches)}."
        )
    if proposal.best is not None and proposal.changes:
        saving = now.cost_usd - proposal.best.outcome.cost_usd
        lines.append("Proposed change:")
        lines += [f"  {change}" for change in proposal.changes]
        lines.append(
            f"Predicted cost {proposal.best.outcome.cost_usd:.6f} USD instead of "
            f"{now.cost_usd:.6f} USD over the trace ({saving / now.cost_usd:.1%} less)."
            if now.cost_usd
            else ""
        )
    lines += [
        "",
        routes_table(proposal, slo),
        "",
        "Routing:",
        "",
        routing_table(now, proposal.best.outcome if proposal.best else None),
        "",
    ]
    return lines
