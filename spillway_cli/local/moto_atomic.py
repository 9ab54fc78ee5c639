"""moto's DynamoDB with DynamoDB's atomic item writes, for the local stack and tests.

moto's server handles requests in threads, and its DynamoDB backend checks a write's
condition and then applies the write without a lock: two conditional writes on one item
can both pass (two holders of a lease), and two ``ADD``s can lose one. DynamoDB applies
each item write atomically, and the WebSocket API's delivery lease, the async store's
claims and every counter rely on it. ``atomic_dynamodb()`` runs moto's DynamoDB
requests one at a time (a process-wide lock around its request handler), each request's
answer included: moto reads the item it answers with after the operation, and a lock
around the operation alone let a write to the same item from another thread fail that
read with a 500 ("dictionary changed size during iteration") after the write had been
applied, or answer with the other write's values.
``python -m spillway_cli.local.moto_atomic`` is ``python -m moto.server`` with it, and with
``strict_limits``: moto refuses what AWS refuses where moto alone would accept it.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

from spillway.aws.limits import S3_KEY_BYTES

_LOCK = threading.RLock()


def atomic_dynamodb() -> None:
    """Make moto's DynamoDB item operations atomic in this process (once)."""
    from moto.dynamodb.responses import DynamoHandler

    # every DynamoDB request passes here: its operation and the answer read after it
    if not getattr(DynamoHandler.call_action, "_spillway_atomic", False):
        DynamoHandler.call_action = _serialised(DynamoHandler.call_action)  # type: ignore[method-assign]


def _serialised(operation: Any) -> Any:
    @functools.wraps(operation)
    def one_at_a_time(*args: Any, **kwargs: Any) -> Any:
        with _LOCK:
            return operation(*args, **kwargs)

    one_at_a_time._spillway_atomic = True  # type: ignore[attr-defined]
    return one_at_a_time


def strict_limits() -> Callable[[], None]:
    """Make moto refuse, in this process, what AWS refuses and moto accepts; the undo.

    * SQS: a message is its body's UTF-8 bytes *and* its attributes' names, types and
      values, against the queue's ``MaximumMessageSize`` (moto counts the body's
      characters alone): ``InvalidParameterValue``
      (https://docs.aws.amazon.com/AWSSimpleQueueService/latest/SQSDeveloperGuide/quotas-messages.html).
    * S3: a key over 1,024 bytes of UTF-8 is ``KeyTooLongError`` (moto stores it)
      (https://docs.aws.amazon.com/AmazonS3/latest/userguide/object-keys.html).

    DynamoDB's 400 KB item moto refuses itself (``ValidationException``, from 405,000
    bytes: stricter than AWS's 409,600)."""
    from moto.s3.models import S3Backend
    from moto.sqs.models import SQSBackend

    send, put = SQSBackend.send_message, S3Backend.put_object

    @functools.wraps(send)
    def send_message(
        self: Any, queue_name: str, message_body: str, *args: Any, **kwargs: Any
    ) -> Any:
        from moto.sqs.exceptions import InvalidParameterValue

        limit = int(self.get_queue(queue_name).maximum_message_size)
        attributes = kwargs.get("message_attributes") or (args[0] if args else None) or {}
        if len(message_body.encode()) + _attribute_bytes(attributes) > limit:
            raise InvalidParameterValue(
                "One or more parameters are invalid. Reason: Message must be shorter than "
                f"{limit} bytes."
            )
        return send(self, queue_name, message_body, *args, **kwargs)

    @functools.wraps(put)
    def put_object(self: Any, bucket_name: str, key_name: str, *args: Any, **kwargs: Any) -> Any:
        from moto.s3.exceptions import S3ClientError

        if len(key_name.encode()) > S3_KEY_BYTES:
            raise S3ClientError("KeyTooLongError", "Your key is too long")
        return put(self, bucket_name, key_name, *args, **kwargs)

    SQSBackend.send_message = send_message  # type: ignore[method-assign]
    S3Backend.put_object = put_object  # type: ignore[method-assign]

    def undo() -> None:
        SQSBackend.send_message = send  # type: ignore[method-assign]
        S3Backend.put_object = put  # type: ignore[method-assign]

    return undo


def _attribute_bytes(attributes: Mapping[str, Any]) -> int:
    """Message attributes' bytes as SQS counts them: each name, data type and value (a
    binary value as moto holds it, base64: a little stricter than SQS)."""
    total = 0
    for name, attribute in attributes.items():
        total += len(name.encode())
        for value in (attribute or {}).values():
            total += len(value) if isinstance(value, bytes) else len(str(value).encode())
    return total


def main(argv: list[str] | None = None) -> None:
    """``python -m moto.server``'s arguments, DynamoDB made atomic, AWS's limits kept."""
    from moto.server import main as moto_main

    atomic_dynamodb()
    strict_limits()
    moto_main(argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    main()
