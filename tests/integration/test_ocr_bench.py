"""The OCR benchmark's script, run quickly: RapidOCR's loop and both services (ocr-rec's
batching on and off) answer every page, and the table holds real figures."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench import ocr_bench

pytest.importorskip("rapidocr_onnxruntime")


def test_the_pages_are_the_same_on_every_run() -> None:
    assert ocr_bench.pages(3) == ocr_bench.pages(3)
    assert len(set(ocr_bench.pages(3))) == 3


def test_the_ocr_benchmark_runs_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "bench-ocr.md"
    ocr_bench.main(["--quick", "--out", str(out)])
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ")][1:]
    cells = [[c.strip() for c in row.split("|")[1:-1]] for row in rows]
    # RapidOCR's loop, the service at c1 and c2, ocr-rec one crop a run at c2
    assert [(c[0], c[1]) for c in cells] == [
        ("RapidOCR() loop, 1 process", "1"),
        (ocr_bench.LABELS["on"], "1"),
        (ocr_bench.LABELS["on"], "2"),
        (ocr_bench.LABELS["off"], "2"),
    ]
    for row in cells:
        assert float(row[3]) > 0, row  # pages/s
        assert row[7] == "0", row  # no failed requests
    for row in cells[1:]:
        assert float(row[8]) >= 1.0, row  # ocr-rec ran, at least a row a run
    assert re.search(r"c2: batching on ÷ off: pages/s \d+\.\d\d", out.read_text())
