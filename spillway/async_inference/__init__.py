"""Asynchronous inference: a request is accepted at once and answered later, once.

The router (``store.AsyncStore.submit``) stages the request body in S3, writes its record
to DynamoDB (``queued``) and sends its id to an SQS queue. A consumer — the GPU service
when its batchers have room, the CPU fallback when the oldest request has waited too long
— ``receive``\\ s ids, ``claim``\\ s the record (``running``, under a lease as long as the
message's visibility timeout), runs the request through the ordinary pipeline and
``settle``\\ s it: the result goes to S3 under a key only that attempt writes, and the
record flips to ``succeeded`` or ``failed`` with one conditional write, so whatever SQS
redelivers and whichever consumer crashes, exactly one result is ever visible. A
request that fails for a reason of the server's is retried until its ``max_attempts``-th
delivery; then its record says ``failed`` with the error and the message moves to the
queue's dead-letter queue (its redrive target: SQS's own redrive also catches a message
whose consumers crash before settling it). A client's error (400) fails at once.

One tenancy model: every place a request names lies in its caller's own area, results
go to keys the server chooses (``objects``). An ``Idempotency-Key`` is scoped to the
caller and bound to a digest of (model, version, payload): another request under the
same key is 409 (``records``). Consumers take their deliveries in ``queue.fair_order``:
the tenant with the fewest requests running goes first.

The modules:

* ``settings`` — ``AsyncSettings`` (``ASYNC_*``).
* ``records`` — the record's schema, its DynamoDB item and the id scheme.
* ``states`` — the transitions a record may make (claim, lease, settle, release,
  lost), as plain decisions.
* ``store`` — ``AsyncStore``: each transition as one conditional DynamoDB write.
* ``objects`` — bodies and results in S3, inside tenants' areas.
* ``queue`` — the SQS protocol, the dead-letter path and SNS notifications.
* ``replies`` — replies to records and records to HTTP replies.

No numpy here: the router imports this package.
"""
