"""The queue of asynchronous requests (SQS) and its notifications (SNS).

A message carries a request's id and its tenant's scope, never its payload; a consumer
receives a few, holds them under the queue's visibility timeout (its lease), and deletes
each once its request needs no more attempts. A request given up on goes to the queue's
dead-letter queue with its error; every finished request is told to the topic.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from spillway.async_inference.replies import error_of
from spillway.protocol.replies import Reply

_QUEUE_COUNTS = (
    "ApproximateNumberOfMessages",
    "ApproximateNumberOfMessagesNotVisible",
    "ApproximateNumberOfMessagesDelayed",
)


@dataclass(frozen=True)
class Message:
    """A delivery of one request id from the queue."""

    id: str
    receipt: str
    receive_count: int
    scope: str = ""
    """The requesting tenant's key segment (for ``fair_order``; never its name)."""


def message_of(raw: Mapping[str, Any]) -> Message:
    """A delivery from SQS's ``ReceiveMessage`` or a Lambda SQS event record."""
    try:
        body = json.loads(raw.get("Body") or raw.get("body") or "{}")
        rid, owner = str(body.get("id", "")), str(body.get("scope", ""))[:64]
    except (ValueError, AttributeError):
        rid, owner = "", ""
    attributes = raw.get("Attributes") or raw.get("attributes") or {}
    return Message(
        id=rid,
        receipt=str(raw.get("ReceiptHandle") or raw.get("receiptHandle") or ""),
        receive_count=int(attributes.get("ApproximateReceiveCount", 1)),
        scope=owner,
    )


def fair_order(messages: Iterable[Message], running: Mapping[str, int]) -> list[Message]:
    """The deliveries in the order to run them: each next one from the tenant with the
    fewest requests running (``running``, by scope) plus those picked before it, first
    come first served among equals. One tenant's burst so waits its turn behind
    another's single request instead of ahead of it."""
    load = Counter(running)
    left = list(messages)
    order: list[Message] = []
    while left:
        best = min(range(len(left)), key=lambda i: (load[left[i].scope], i))
        message = left.pop(best)
        load[message.scope] += 1
        order.append(message)
    return order


class AsyncQueue:
    """The SQS queue of request ids (and the SNS topic told of finished requests)."""

    def __init__(
        self, queue_url: str, lease_s: int, topic_arn: str | None, clients: Callable[[str], Any]
    ) -> None:
        self.url = queue_url
        self.lease_s = lease_s
        self.topic_arn = topic_arn
        self._clients = clients

    def send(self, rid: str, scope: str | None) -> None:
        """Queue a request's id (with its tenant's scope, for ``fair_order``)."""
        body = json.dumps({"id": rid, "scope": scope})
        self._clients("sqs").send_message(QueueUrl=self.url, MessageBody=body)

    def receive(self, count: int, wait_s: float) -> list[Message]:
        """Up to ``count`` (≤ 10) deliveries, long-polling up to ``wait_s`` seconds."""
        answer = self._clients("sqs").receive_message(
            QueueUrl=self.url,
            MaxNumberOfMessages=max(1, min(count, 10)),
            WaitTimeSeconds=int(max(0, min(wait_s, 20))),
            VisibilityTimeout=self.lease_s,
            AttributeNames=["ApproximateReceiveCount"],
        )
        return [message_of(m) for m in answer.get("Messages", [])]

    def show_in(self, message: Message, seconds: int) -> None:
        """Hide a delivery for ``seconds`` more: the queue shows it again then."""
        self._clients("sqs").change_message_visibility(
            QueueUrl=self.url, ReceiptHandle=message.receipt, VisibilityTimeout=seconds
        )

    def delete(self, message: Message) -> None:
        """Remove a delivery from the queue (its request needs no more attempts); a
        receipt that is no longer valid (the message was redelivered) is left alone."""
        if not message.receipt:  # an execution-run request: it was never queued
            return
        from spillway.aws.errors import ClientError, error_code

        try:
            self._clients("sqs").delete_message(QueueUrl=self.url, ReceiptHandle=message.receipt)
        except ClientError as exc:
            code = error_code(exc)
            if "ReceiptHandleIsInvalid" not in code and code != "InvalidParameterValue":
                raise

    def dead_letter(self, message: Message, reply: Reply) -> None:
        """Move a request given up on to the queue's dead-letter queue (its redrive
        policy's target) with its error, at once: it does not wait for another receive
        that may never come (a drained backlog stops the CPU consumer's polling)."""
        sqs = self._clients("sqs")
        attributes = sqs.get_queue_attributes(
            QueueUrl=self.url, AttributeNames=["RedrivePolicy"]
        ).get("Attributes", {})
        policy = json.loads(attributes.get("RedrivePolicy") or "{}")
        target = str(policy.get("deadLetterTargetArn", ""))
        if target:
            name = target.rsplit(":", 1)[-1]
            code, error = error_of(reply)
            body = json.dumps({"id": message.id, "status": reply.status, "code": code,
                               "error": error, "deliveries": message.receive_count})  # fmt: skip
            dlq = sqs.get_queue_url(QueueName=name)["QueueUrl"]
            sqs.send_message(QueueUrl=dlq, MessageBody=body)
        self.delete(message)

    def is_empty(self) -> bool:
        """Whether the queue holds no message at all: none waiting, in flight or delayed
        (SQS's approximate counts, about a minute behind)."""
        counts = (
            self._clients("sqs")
            .get_queue_attributes(QueueUrl=self.url, AttributeNames=list(_QUEUE_COUNTS))
            .get("Attributes", {})
        )
        return all(int(counts.get(name, 0)) == 0 for name in _QUEUE_COUNTS)

    def notify(self, rid: str, state: str, status: int) -> None:
        """Tell the topic (if any) that a request finished."""
        if self.topic_arn:
            message = json.dumps({"id": rid, "state": state, "status": status})
            self._clients("sns").publish(TopicArn=self.topic_arn, Message=message)
