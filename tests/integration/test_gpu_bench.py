"""``make bench-gpu``'s script, run quickly on the CPU: every model loads, is measured raw
and through the service at each concurrency, and the report holds real figures."""

from __future__ import annotations

import re
from pathlib import Path

from bench import gpu_bench


def test_the_gpu_benchmark_runs_end_to_end_on_the_cpu(models_dir: Path, tmp_path: Path) -> None:
    gpu_bench.main(
        [
            "--quick",
            "--providers",
            "CPUExecutionProvider",
            "--models",
            str(models_dir),
            "--out",
            str(tmp_path),
        ]
    )
    table = (tmp_path / "bench-gpu.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if "| " in line}
    for name in ("mlp-bench", "minilm-ids", "resnet50"):
        cells = [c.strip() for c in rows[name].split("|")[1:-1]]
        rates = [float(x.replace(",", "")) for x in cells[2].split(" / ") + cells[4].split(" / ")]
        assert all(rate > 0 for rate in rates), cells
        assert re.fullmatch(r"\d+\.\d\d", cells[6]), cells  # c64 / raw b64
        assert cells[8] != "n/a"  # memory measured
        assert cells[9] == "0"  # no failed requests
