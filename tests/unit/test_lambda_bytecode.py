"""The zip functions ship python3.12 byte-code (Lambda's task root is read-only, so a
module without it is compiled from source on every cold start)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_router_code_ships_unchecked_python312_bytecode(tmp_path: Path) -> None:
    out = tmp_path / "router"
    subprocess.run(
        [
            "make",
            "-s",
            "-f",
            "infra/lambda/Makefile",
            "build-RouterFunction",
            f"ARTIFACTS_DIR={out}",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    handler = out / "functions/router/__pycache__/handler.cpython-312.pyc"
    assert handler.is_file()
    # PEP 552 flags: bit 0 hash-based, bit 1 check_source; unchecked-hash is 0b01, so the
    # zip's file times never make the runtime recompile.
    flags = int.from_bytes(handler.read_bytes()[4:8], "little")
    assert flags == 0b01
    sources = {p.relative_to(out).with_suffix("") for p in out.rglob("*.py")}
    compiled = {
        (p.parent.parent / p.name.split(".")[0]).relative_to(out) for p in out.rglob("*.pyc")
    }
    assert sources <= compiled
