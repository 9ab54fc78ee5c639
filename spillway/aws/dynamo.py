"""DynamoDB's typed-value codecs (boto3's ``TypeSerializer`` / ``TypeDeserializer``),
made on first use so a process that never touches a table never imports boto3."""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def codecs() -> tuple[Any, Any]:
    """``(serializer, deserializer)``, made once."""
    from boto3.dynamodb.types import TypeDeserializer, TypeSerializer

    return TypeSerializer(), TypeDeserializer()
