"""S3 reads every store shares: an object's bytes, or ``None`` when its key is not there."""

from __future__ import annotations

from typing import Any

from spillway.aws.errors import is_not_found


def get_object_or_none(client: Any, bucket: str, key: str) -> bytes | None:
    """The bytes of ``s3://bucket/key``; ``None`` when there is no such key."""
    try:
        body: bytes = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except client.exceptions.NoSuchKey:
        return None
    return body


def head_object_or_none(client: Any, bucket: str, key: str) -> dict[str, Any] | None:
    """``HeadObject``'s answer for ``s3://bucket/key``; ``None`` when there is no such key
    (a HEAD answers a bare 404)."""
    try:
        meta: dict[str, Any] = client.head_object(Bucket=bucket, Key=key)
    except client.exceptions.ClientError as exc:
        if is_not_found(exc):
            return None
        raise
    return meta
