"""The S3 store on the moto server: a download pinned to the planned ETag."""

from __future__ import annotations

from pathlib import Path

import pytest

from batch_job.storage import open_location
from spillway.aws.clients import aws_client
from spillway.protocol.errors import InputChangedError
from tests.integration.test_jobs_support import new_bucket


def test_a_download_refuses_an_object_replaced_since_it_was_listed(
    aws_env: str, tmp_path: Path
) -> None:
    # GIVEN an input object as the plan listed it
    bucket = new_bucket()
    s3 = aws_client("s3")
    s3.put_object(Bucket=bucket, Key="in/0.jsonl", Body=b'{"id": "a"}\n' * 300)
    store, prefix = open_location(f"s3://{bucket}/in/")
    (listed,) = store.list_objects(prefix)
    # WHEN it is downloaded with its ETag
    store.download(listed.key, tmp_path / "same", listed.etag)
    # THEN it arrives
    assert (tmp_path / "same").read_bytes() == b'{"id": "a"}\n' * 300
    # WHEN it is replaced and downloaded again with the planned ETag
    s3.put_object(Bucket=bucket, Key="in/0.jsonl", Body=b'{"id": "b"}\n' * 5)
    with pytest.raises(InputChangedError, match=r"s3://.*/in/0\.jsonl changed") as caught:
        store.download(listed.key, tmp_path / "changed", listed.etag)
    # THEN it is refused with the input's code
    assert caught.value.code == "input_changed"
    assert not (tmp_path / "changed").exists()
