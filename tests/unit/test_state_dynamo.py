"""The one way the core writes and reads DynamoDB items: typed values through boto3's
serializer (floats through ``Decimal``), plain values back, and one test for a write whose
condition failed."""

from __future__ import annotations

from decimal import Decimal

import pytest
from botocore.exceptions import ClientError

from spillway.async_inference.records import AsyncRecord, from_item, to_item
from spillway.aws.errors import is_condition_failed
from spillway.state import dynamo


def _client_error(code: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "no"}}, "UpdateItem")


def test_values_take_dynamodbs_typed_form() -> None:
    item = dynamo.item(
        {
            "id": "abc",
            "n": 3,
            "at": 1_800_000_000.25,
            "flag": True,
            "body": b"\x00\x01",
            "gone": None,
        }
    )

    assert item == {
        "id": {"S": "abc"},
        "n": {"N": "3"},
        "at": {"N": "1800000000.25"},
        "flag": {"BOOL": True},
        "body": {"B": b"\x00\x01"},
    }


def test_typed_values_come_back_plain() -> None:
    typed = {"n": {"N": "3"}, "at": {"N": "1800000000.25"}, "s": {"S": "x"}, "b": {"B": b"\x02"}}

    plain = dynamo.plain_item(typed)

    assert plain == {"n": 3, "at": 1_800_000_000.25, "s": "x", "b": b"\x02"}
    assert type(plain["n"]) is int
    assert type(plain["at"]) is float
    assert type(plain["b"]) is bytes


@pytest.mark.parametrize("value", [0.1, 1e-7, 123456789.123456, -2.5, 1_800_000_000.0])
def test_a_float_survives_the_round_trip(value: float) -> None:
    back = dynamo.plain(dynamo.typed(value))

    assert back == value
    assert Decimal(dynamo.typed(value)["N"]) == Decimal(repr(value))


def test_an_async_record_item_keeps_its_stored_shape() -> None:
    record = AsyncRecord(
        id="0" * 32,
        tenant="alice",
        model="sum",
        state="running",
        created_at=1_800_000_000.5,
        updated_at=1_800_000_001.0,
        expires_at=1_800_086_400,
        input="s3://b/in",
        output="s3://b/out/",
        attempts=2,
        lease_until=1_800_000_060.5,
    )

    item = to_item(record)

    assert item["created_at"] == {"N": "1800000000.5"}
    assert item["updated_at"] == {"N": "1800000001.0"}
    assert item["expires_at"] == {"N": "1800086400"}
    assert item["attempts"] == {"N": "2"}
    assert item["state"] == {"S": "running"}
    assert "owner" not in item  # unset fields are left out
    assert from_item({**item, "pending": {"S": "1"}}) == record


def test_only_a_failed_condition_is_a_failed_condition() -> None:
    assert is_condition_failed(_client_error("ConditionalCheckFailedException"))
    assert not is_condition_failed(_client_error("ProvisionedThroughputExceededException"))
    assert not is_condition_failed(ValueError("ConditionalCheckFailedException"))


def test_a_conditional_write_answers_none_only_when_its_condition_failed() -> None:
    def refused(**_: object) -> dict[str, object]:
        raise _client_error("ConditionalCheckFailedException")

    def throttled(**_: object) -> dict[str, object]:
        raise _client_error("ThrottlingException")

    assert dynamo.conditional(lambda **kw: {"Attributes": kw}, Key=1) == {"Attributes": {"Key": 1}}
    assert dynamo.conditional(refused, Key=1) is None
    with pytest.raises(ClientError):
        dynamo.conditional(throttled, Key=1)
