"""What a request cost: a pricing configuration and the estimate of each route.

* Lambda (the router itself and the CPU fallback): billed duration rounded up to the
  millisecond × memory in GB × price per GB-second, plus the price per request. Every
  invocation is billed, failed ones too.
* GPU service and AWS Batch: the instance's price per hour spread over its measured
  throughput (inferences, i.e. rows, per second) × the request's rows. Capacity is paid
  whether or not it is used, so this is the marginal share of a busy instance.

The defaults are us-east-1 on-demand list prices (x86 Lambda; a g5.xlarge for the GPU
service and the Batch compute environment); put the figures of your region and your
measured throughput in a pricing file (``config/pricing.yaml``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LambdaPrice(_Strict):
    """A Lambda function's price: per GB-second of billed duration and per request."""

    usd_per_gb_second: float = Field(default=0.0000166667, ge=0)
    usd_per_request: float = Field(default=0.0000002, ge=0)
    memory_mb: int = Field(default=512, ge=128, le=10240)

    def cost(self, duration_s: float) -> float:
        """The bill of one invocation that ran ``duration_s`` seconds."""
        billed_ms = math.ceil(max(duration_s, 0.0) * 1000)
        return billed_ms / 1000 * self.memory_mb / 1024 * self.usd_per_gb_second + (
            self.usd_per_request
        )


class CapacityPrice(_Strict):
    """Provisioned capacity: its price per hour and its measured throughput."""

    usd_per_hour: float = Field(ge=0)
    inferences_per_second: float = Field(gt=0)

    def cost(self, rows: int) -> float:
        """The share of an hour of capacity that ``rows`` inferences use."""
        return self.usd_per_hour / 3600 / self.inferences_per_second * max(rows, 1)


class Pricing(_Strict):
    """Prices of every route."""

    router: LambdaPrice = Field(default_factory=lambda: LambdaPrice(memory_mb=512))
    cpu: LambdaPrice = Field(default_factory=lambda: LambdaPrice(memory_mb=3008))
    gpu: CapacityPrice = Field(
        default_factory=lambda: CapacityPrice(usd_per_hour=1.006, inferences_per_second=400)
    )
    batch: CapacityPrice = Field(
        default_factory=lambda: CapacityPrice(usd_per_hour=1.006, inferences_per_second=2000)
    )

    def attempt(self, backend: str, *, rows: int, billed_s: float, served: bool) -> float:
        """The cost of one attempt on ``backend`` (failed Lambda calls are billed too)."""
        if backend == "cpu":
            return self.cpu.cost(billed_s)
        if not served:
            return 0.0
        if backend == "gpu":
            return self.gpu.cost(rows)
        if backend == "batch":
            return self.batch.cost(rows)
        return 0.0


def load_pricing(path: Path | None) -> Pricing:
    """The pricing in ``path`` (YAML or JSON), or the defaults when ``path`` is ``None``."""
    if path is None:
        return Pricing()
    text = path.read_text()
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
        return Pricing.model_validate(data or {})
    except (ValueError, ValidationError) as exc:
        raise ValueError(f"{path}: invalid pricing: {exc}") from None
