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
``python -m spillway_cli.moto_atomic`` is ``python -m moto.server`` with it.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any

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


def main(argv: list[str] | None = None) -> None:
    """``python -m moto.server``'s arguments, DynamoDB made atomic."""
    from moto.server import main as moto_main

    atomic_dynamodb()
    moto_main(argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    main()
