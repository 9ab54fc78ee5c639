"""What the demo shows besides each section's lines: the terminal line itself, the
summary per backend of the recorded requests, the canary's by-design failures reported
apart from the error totals, and the chart of latency and routing over time."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import typer

from spillway_cli.demo.canary import CanaryReport
from spillway_cli.demo.client import Client


def say(text: str) -> None:
    """A line of the report on the terminal (log lines go to files)."""
    typer.echo(text)


def summary(client: Client) -> str:
    """Requests per backend of the sections that use the recording client (``Section.
    recorded``), with their latencies, errors (non-200 answers) and cost."""
    rows = [
        "| backend | requests | p50 ms | p99 ms | errors | cost USD |",
        "|---|---|---|---|---|---|",
    ]
    for backend in sorted({r.backend for r in client.records}):
        mine = [r for r in client.records if r.backend == backend]
        lat = np.array([r.latency_ms for r in mine])
        rows.append(
            f"| {backend} | {len(mine)} | {np.percentile(lat, 50):.1f} | "
            f"{np.percentile(lat, 99):.1f} | {sum(r.status != 200 for r in mine)} | "
            f"{sum(r.cost_usd for r in mine):.6f} |"
        )
    return "\n".join(rows)


def apart(canary: CanaryReport, section: int) -> str:
    """The by-design failures of the canary section (number ``section``), reported apart
    from the errors."""
    total = sum(canary.requests.values())
    return (
        f"Intentional failures, apart from the error totals: section {section}'s canary "
        f"v{canary.canary} "
        f"fails 20 % of its inputs on purpose; it failed {canary.by_design_failures} of the "
        f"section's {total} requests before the router rolled it back. They are counted in "
        "no error total above, and the section's checks say what had to hold there."
    )


def chart(client: Client, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for backend in sorted({r.backend for r in client.records}):
        mine = [r for r in client.records if r.backend == backend]
        ax.scatter([r.at for r in mine], [r.latency_ms for r in mine], s=4, label=backend)
    for scenario in ("gpu-killed", "hot-swap"):
        times = [r.at for r in client.records if r.scenario == scenario]
        if times:
            ax.axvspan(min(times), max(times), alpha=0.1)
            ax.text(
                min(times),
                ax.get_ylim()[1] if ax.get_ylim()[1] else 1,
                scenario,
                fontsize=8,
                va="top",
            )
    ax.set_yscale("log")
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("latency (ms)")
    ax.set_title("Spillway demo: latency and routing over time")
    ax.legend(title="backend", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
