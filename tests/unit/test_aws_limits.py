"""The table of AWS limits (``spillway.aws.limits``): each has its source, the
docs show the table as the code holds it, and the product's own bounds sit within it."""

from __future__ import annotations

from pathlib import Path

from spillway.aws import limits as aws_limits
from spillway.protocol.wire import LAMBDA_PAYLOAD_BYTES, SYNC_BODY_BYTES
from spillway.streams.settings import StreamSettings

ROOT = Path(__file__).resolve().parents[2]


def test_every_limit_cites_an_aws_documentation_page() -> None:
    for limit in aws_limits.LIMITS:
        assert limit.doc.startswith("https://docs.aws.amazon.com/"), limit
        assert limit.value, limit


def test_the_docs_table_is_the_codes() -> None:
    assert (ROOT / "docs" / "aws-limits.md").read_text() == aws_limits.markdown()
    assert "(aws-limits.md)" in (ROOT / "docs" / "deploy.md").read_text()


def test_the_products_bounds_are_within_awss() -> None:
    assert LAMBDA_PAYLOAD_BYTES == aws_limits.LAMBDA_SYNC_PAYLOAD_BYTES
    assert SYNC_BODY_BYTES * 4 // 3 < aws_limits.LAMBDA_SYNC_PAYLOAD_BYTES
    assert StreamSettings().max_message_bytes <= aws_limits.WS_MESSAGE_BYTES
