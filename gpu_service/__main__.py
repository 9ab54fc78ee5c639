"""``python -m gpu_service``: the container's command; settings from ``GPU_*`` variables."""

from __future__ import annotations

from gpu_service.server import serve
from gpu_service.settings import GpuSettings

if __name__ == "__main__":
    serve(GpuSettings())
