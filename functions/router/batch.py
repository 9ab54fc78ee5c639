"""Batch mode: hand an infer request to the offline jobs API and answer 202 with a job id.

Running jobs belongs to the batch job and the jobs function; the router only submits.
``BatchSubmitter`` is the seam. The default, ``JobsApiSubmitter``, speaks the jobs API
(``POST /v1/jobs``), which reads its input from S3: it writes the request's rows as
JSON Lines records under ``ROUTER_JOBS_STAGING`` and submits::

    PUT  s3://<staging>/<key>/in/records.jsonl      ({"id", "data"} per row)
    POST {ROUTER_JOBS_URL}   Idempotency-Key: <request id>
         {"model": "digits", "version": null,
          "input": "s3://<staging>/<key>/in/", "output": "s3://<staging>/<key>/out/"}
    -> 202 {"job": {"job_id": "...", ...}}, Location: /v1/jobs/<id>

``<key>`` is derived from the request id, so a retried request (same ``x-request-id``)
replays the same job instead of starting another. Without a jobs URL and a staging
prefix, batch-mode requests get 503 with a message that says so.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from functions.router.backends import (
    BackendError,
    BackendRequest,
    BackendResponse,
    HttpBackend,
)
from functions.router.facts import HEADER_LENGTH, header_length_from, read_json_header
from functions.router.staging import records
from spillway.errors import InvalidInputError, UnavailableError


@dataclass(frozen=True)
class BatchReceipt:
    """A submitted job: its id and, when the jobs API gives one, where to poll it."""

    job_id: str
    status_url: str | None = None


class BatchSubmitter(Protocol):
    """Submits one infer request as an offline job."""

    def submit(self, request: BackendRequest, timeout_s: float) -> BatchReceipt:
        """The job's receipt; raises ``SpillwayError`` or ``BackendError`` on failure."""
        ...


class JobsApiSubmitter:
    """Stages the request's rows in S3 and submits a job to the jobs API."""

    def __init__(self, jobs_url: str, staging: str, *, s3: Any = None) -> None:
        if not staging.startswith("s3://") or not staging[5:].split("/")[0]:
            raise ValueError(f"jobs staging {staging!r} is not s3://bucket[/prefix]")
        self._bucket, _, prefix = staging[5:].partition("/")
        self._prefix = prefix.strip("/")
        self._http = HttpBackend("jobs", jobs_url, pool_size=4)
        self._s3 = s3
        self._lock = threading.Lock()

    def _client(self) -> Any:
        with self._lock:
            if self._s3 is None:
                import boto3
                from botocore.config import Config

                config = Config(connect_timeout=2, read_timeout=10, retries={"max_attempts": 2})
                self._s3 = boto3.client("s3", config=config)
            return self._s3

    def submit(self, request: BackendRequest, timeout_s: float) -> BatchReceipt:
        """Write the records, then POST the job; its receipt, or ``UnavailableError``."""
        if request.model is None:
            raise InvalidInputError("batch mode needs a model")
        length = header_length_from(request.headers.get(HEADER_LENGTH))
        header = read_json_header(request.body, length)
        binary = request.body[length:] if length is not None else b""
        lines = records(header, binary, request.request_id)
        digest = hashlib.sha256(request.request_id.encode()).hexdigest()[:32]
        key = f"{self._prefix}/{digest}" if self._prefix else digest
        self._client().put_object(
            Bucket=self._bucket, Key=f"{key}/in/records.jsonl", Body="\n".join(lines).encode()
        )
        job = {
            "model": request.model,
            "version": int(request.version) if request.version else None,
            "input": f"s3://{self._bucket}/{key}/in/",
            "output": f"s3://{self._bucket}/{key}/out/",
        }
        post = BackendRequest(
            "POST",
            "",
            "submit",
            headers={"content-type": "application/json", "idempotency-key": request.request_id},
            body=json.dumps(job).encode(),
            request_id=request.request_id,
        )
        return _receipt(self._http.send(post, timeout_s))


class JobRefused(Exception):
    """The jobs API refused the submission for a reason of the request's own (4xx)."""

    def __init__(self, answer: BackendResponse) -> None:
        super().__init__(f"the jobs API answered {answer.status}")
        self.answer = answer


def _receipt(answer: BackendResponse) -> BatchReceipt:
    if 400 <= answer.status < 500 and answer.status != 429:
        raise JobRefused(answer)
    if answer.status not in (200, 201, 202):
        raise UnavailableError(f"the jobs API answered {answer.status}")
    try:
        receipt = json.loads(answer.body)
        job = receipt.get("job", receipt)  # {"job": {"job_id"}} or {"job_id"}
        status_url = receipt.get("status_url") or answer.headers.get("location")
        return BatchReceipt(str(job["job_id"]), status_url)
    except (ValueError, KeyError, TypeError, AttributeError):
        raise UnavailableError("the jobs API sent no job_id") from None


class BatchBackend:
    """The ``batch`` backend: submit, then answer 202 with the job id."""

    def __init__(self, submitter: BatchSubmitter | None) -> None:
        self.name = "batch"
        self._submitter = submitter

    def send(self, request: BackendRequest, timeout_s: float) -> BackendResponse:
        """Submit the request as a job; only infer requests can become jobs."""
        if self._submitter is None:
            raise UnavailableError(
                "batch mode is not configured on this router "
                "(set ROUTER_JOBS_URL and ROUTER_JOBS_STAGING)"
            )
        if request.operation != "infer":
            raise UnavailableError("only infer requests can run in batch mode")
        started = time.monotonic()
        try:
            receipt = self._submitter.submit(request, timeout_s)
        except JobRefused as refused:  # e.g. an unknown model: the client's to fix
            return refused.answer
        except BackendError as exc:
            raise UnavailableError(f"the jobs API could not be reached ({exc.kind})") from exc
        body: dict[str, str] = {"job_id": receipt.job_id, "status": "submitted"}
        headers = {"content-type": "application/json"}
        if receipt.status_url:
            body["status_url"] = receipt.status_url
            headers["location"] = receipt.status_url
        return BackendResponse(202, headers, json.dumps(body).encode(), time.monotonic() - started)
