"""DynamoDB items, written and read one way by every store in the core.

Attribute values go to and from DynamoDB's typed form (``{"S": ...}``, ``{"N": ...}``)
through boto3's ``TypeSerializer`` / ``TypeDeserializer`` (``spillway.aws.dynamo``),
imported on first use so a process that never touches a table never imports boto3. Floats
go in through ``Decimal`` (their ``repr``: the serializer refuses floats) and numbers come
back as ``int`` when whole, else ``float``; binary comes back as ``bytes``. A write whose
condition did not hold is told from every other failure by
``spillway.aws.errors.is_condition_failed`` alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import Any

from spillway.aws.dynamo import codecs
from spillway.aws.errors import is_condition_failed


def typed(value: Any) -> dict[str, Any]:
    """One attribute value in DynamoDB's typed form."""
    if isinstance(value, float):
        value = Decimal(repr(value))
    answer: dict[str, Any] = codecs()[0].serialize(value)
    return answer


def item(values: Mapping[str, Any]) -> dict[str, Any]:
    """An item (or a map of expression values) in DynamoDB's typed form; ``None`` values
    are left out."""
    return {name: typed(value) for name, value in values.items() if value is not None}


def plain(value: Mapping[str, Any]) -> Any:
    """One typed attribute value as Python: whole numbers as ``int``, other numbers as
    ``float``, binary as ``bytes``."""
    answer = codecs()[1].deserialize(value)
    if isinstance(answer, Decimal):
        return int(answer) if answer == answer.to_integral_value() else float(answer)
    raw = getattr(answer, "value", None)  # boto3's ``Binary`` wrapper
    return raw if isinstance(raw, bytes) else answer


def plain_item(typed_item: Mapping[str, Any]) -> dict[str, Any]:
    """An item read from DynamoDB as Python values (``plain`` of each attribute)."""
    return {name: plain(value) for name, value in typed_item.items()}


def conditional(call: Callable[..., Any], **kwargs: Any) -> dict[str, Any] | None:
    """One conditional DynamoDB write: its answer, or ``None`` when its condition did not
    hold (any other failure is raised)."""
    from spillway.aws.errors import ClientError

    try:
        answer: dict[str, Any] = call(**kwargs)
    except ClientError as exc:
        if is_condition_failed(exc):
            return None
        raise
    return answer


def conditional_or_old(
    call: Callable[..., Any], **kwargs: Any
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """One conditional DynamoDB write that, when its condition does not hold, says why:
    ``(answer, None)`` when it was written; ``(None, item)`` when not, ``item`` the typed
    item exactly as the condition saw it (``None``: there was none). Reading the item
    again after a failed write could see a later state, one the condition never met."""
    from spillway.aws.errors import ClientError

    try:
        answer: dict[str, Any] = call(ReturnValuesOnConditionCheckFailure="ALL_OLD", **kwargs)
    except ClientError as exc:
        if is_condition_failed(exc):
            return None, exc.response.get("Item")
        raise
    return answer, None
