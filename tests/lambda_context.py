"""A stand-in for the context the Lambda runtime passes a handler."""

from __future__ import annotations


class LambdaContext:
    """What the Lambda runtime passes as ``context`` (the fields Powertools reads)."""

    function_name = "spillway-router"
    function_version = "$LATEST"
    invoked_function_arn = "arn:aws:lambda:us-east-1:123456789012:function:spillway-router"
    memory_limit_in_mb = 512
    aws_request_id = "6f1c0cd2-5b5a-4b59-9d44-6a6e6f1b8c1e"
    log_group_name = "/aws/lambda/spillway-router"
    log_stream_name = "2026/01/15/[$LATEST]abc"

    def __init__(self, remaining_ms: int = 30_000) -> None:
        self.remaining_ms = remaining_ms

    def get_remaining_time_in_millis(self) -> int:
        return self.remaining_ms
