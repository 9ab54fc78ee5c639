"""The OCR benchmark's script, run quickly: RapidOCR's loop and the service answer every
page, digits answers at a steady rate alone and beside pages, and the tables hold real
figures."""

from __future__ import annotations

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
    text = out.read_text()
    tables = [
        [[c.strip() for c in row.split("|")[1:-1]] for row in block]
        for block in _tables(text.splitlines())
    ]
    pages, digits = tables
    # RapidOCR's loop, then the service at c1 and c2
    assert [(c[0], c[1]) for c in pages] == [
        ("RapidOCR() loop, 1 process", "1"),
        (ocr_bench.SERVICE, "1"),
        (ocr_bench.SERVICE, "2"),
    ]
    for row in pages:
        assert float(row[3]) > 0, row  # pages/s
        assert row[9] == "0 (0)", row  # no failed requests
    assert pages[1][5] == "1.00"  # the service's own c1 rate
    for row in pages[1:]:
        assert float(row[10]) >= 1.0, row  # ocr-rec ran, at least a row a run
    # digits alone and under pages, every request answered
    assert [(c[0], c[1]) for c in digits] == [
        (ocr_bench.SERVICE, "alone"),
        (ocr_bench.SERVICE, "under pages"),
    ]
    for row in digits:
        assert int(row[2]) > 0, row
        assert row[6] == "0", row
        assert float(row[4]) >= float(row[3]) > 0, row  # p99 >= p50
    assert digits[0][5] == "1.00"
    assert float(digits[1][7]) > 0  # pages were answered beside it


def _tables(lines: list[str]) -> list[list[str]]:
    """Each markdown table's body rows (its head and rule left out)."""
    blocks: list[list[str]] = []
    current: list[str] = []
    for line in [*lines, ""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            blocks.append(current[2:])
            current = []
    return blocks
