"""The batch job: offline inference over S3 data as AWS Batch array jobs.

Two halves share this package. The job container (``spillway jobs run``) plans shards,
runs them through the core engine at full batch size and commits each shard atomically;
the submission side (the jobs Lambda, ``spillway jobs submit``) plans, submits the Batch
array job, keeps the job record in DynamoDB and reports status. The submission half never
imports onnxruntime, so the Lambda's cold start stays small.
"""

from __future__ import annotations
