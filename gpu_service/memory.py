"""Memory footprints of loaded model versions, and the budget they share.

A version's footprint is measured while it loads (loads run one at a time, so the delta is
its own): on CUDA the growth of used device memory read through NVML when ``pynvml`` is
importable; otherwise, and on the CPU, the growth of the process's resident set size
(``/proc/self/statm``) across session creation and warm-up. Before a load the footprint is
estimated from an earlier measurement of the same model, else from its files' size × 1.5.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
ESTIMATE_FACTOR = 1.5


def resident_bytes() -> int:
    """The process's resident set size."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path("/proc/self/statm").read_text().split()[1]) * _PAGE
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def device_bytes() -> int | None:
    """Used memory of CUDA device 0 via NVML, or None when NVML is not available."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    except pynvml.NVMLError:
        return None


class Probe:
    """Measures one load: device memory for CUDA sessions, resident memory otherwise."""

    def __init__(self, on_device: bool) -> None:
        self.on_device = on_device and device_bytes() is not None
        self.method = "nvml-device" if self.on_device else "rss"
        self._start = self._read()

    def _read(self) -> int:
        return (device_bytes() or 0) if self.on_device else resident_bytes()

    def grown(self) -> int:
        """Bytes added since the probe started (never negative)."""
        return max(0, self._read() - self._start)


def estimate(version_dir: Path, known: int | None) -> int:
    """The footprint to reserve before loading."""
    if known:
        return known
    size = sum(p.stat().st_size for p in version_dir.iterdir() if p.is_file())
    return int(size * ESTIMATE_FACTOR)
