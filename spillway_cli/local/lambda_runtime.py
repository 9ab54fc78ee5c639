"""What the local doors do in Lambda's place: a handler imported by its dotted name in
this process (as Lambda's init imports it, once), and the context each invocation is
given."""

from __future__ import annotations

import importlib
import time
import uuid
from collections.abc import Callable
from typing import Any

Handler = Callable[[dict[str, Any], Any], Any]
"""A Lambda handler: an event and the context -> the function's answer."""
ACCOUNT = "123456789012"
REGION = "us-east-1"


def load_handler(dotted: str) -> Handler:
    """The callable ``module.path.name`` names, imported in this process."""
    module, _, name = dotted.rpartition(".")
    if not module:
        raise ValueError(f"{dotted!r} is not module.attribute")
    handler: Handler = getattr(importlib.import_module(module), name)
    return handler


class LambdaContext:
    """The parts of a Lambda context a handler reads; the remaining time counts down
    from ``timeout_s`` (the function's timeout, or the integration timeout of the door
    in front of it)."""

    function_version = "$LATEST"
    memory_limit_in_mb = 1024
    log_stream_name = "local"

    def __init__(self, function_name: str, timeout_s: float) -> None:
        self.function_name = function_name
        self.invoked_function_arn = f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:{function_name}"
        self.log_group_name = f"/aws/lambda/{function_name}"
        self.aws_request_id = str(uuid.uuid4())
        self._deadline = time.monotonic() + timeout_s

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self._deadline - time.monotonic()) * 1000))
