"""Step Functions on 127.0.0.1: ``LocalStepFunctions`` serves the two calls of its API that
Spillway makes (``StartExecution``, ``DescribeExecution``) over HTTP, so the router's
boto3 client (``AWS_ENDPOINT_URL_SFN``) starts executions that the local interpreter
(``spillway_cli.local.states``) runs. It refuses a
start as StartExecution does
(https://docs.aws.amazon.com/step-functions/latest/apireference/API_StartExecution.html):
a name longer than 80 characters or an input over 262,144 bytes of UTF-8 is a
``ValidationException``, a name with a forbidden character ``InvalidName``, input that is
no JSON ``InvalidExecutionInput``, and a name already used ``ExecutionAlreadyExists``
unless its execution is still running with the same input (Standard workflows keep a
name for 90 days after the execution ends; here, for the life of the stack).
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from spillway.aws.limits import SFN_EXECUTION_NAME_CHARS, SFN_PAYLOAD_BYTES
from spillway_cli.local.states import Execution, LocalStateMachine

_TARGET = "AWSStepFunctions."
_JSON = "application/x-amz-json-1.0"
_STATUS = {"SUCCEEDED": "SUCCEEDED", "FAILED": "FAILED"}
_FORBIDDEN = re.compile(r'[\s<>{}\[\]?*"#%\\^|~`$&,;:/\x00-\x1f\x7f-\x9f]')
"""What an execution name must not contain (API_StartExecution): whitespace, brackets,
wildcards, ``"#%\\^|~`$&,;:/`` and control characters."""
_REQUEST_BYTES = 6 * SFN_PAYLOAD_BYTES + (64 << 10)
"""The longest StartExecution body read: an input at its limit with every character
escaped (``\\uXXXX``) still fits, so the input's own limit decides."""


def _check_start(name: str, document: str) -> None:
    """StartExecution's refusals of a name and an input, as Step Functions words them."""
    if not 1 <= len(name) <= SFN_EXECUTION_NAME_CHARS:
        raise _Refused(
            "ValidationException",
            "1 validation error detected: Value at 'name' failed to satisfy constraint: "
            f"Member must have length less than or equal to {SFN_EXECUTION_NAME_CHARS}",
        )
    if _FORBIDDEN.search(name):
        raise _Refused("InvalidName", f"Invalid Name: '{name}'")
    if len(document.encode()) > SFN_PAYLOAD_BYTES:
        raise _Refused(
            "ValidationException",
            "1 validation error detected: Value at 'input' failed to satisfy constraint: "
            f"Member must have length less than or equal to {SFN_PAYLOAD_BYTES}",
        )
    try:
        json.loads(document)
    except ValueError:
        raise _Refused("InvalidExecutionInput", "Invalid State Machine Execution Input") from None


@dataclass
class _Run:
    machine: str
    name: str
    input: str
    started: float
    future: Future[Execution]


class LocalStepFunctions:
    """Step Functions' ``StartExecution`` and ``DescribeExecution`` over HTTP (a WSGI
    application, JSON 1.0 protocol as boto3 speaks it), running each execution of a
    known state machine with ``LocalStateMachine`` on a bounded pool of threads.

    As on AWS, a standard workflow's execution name is unique per machine: starting the
    same name with the same input while its execution runs answers that execution; with
    another input, or once it has ended, ``ExecutionAlreadyExists`` (for the life of this
    object: AWS keeps the name 90 days)."""

    def __init__(self, machines: Mapping[str, LocalStateMachine], workers: int = 4) -> None:
        self.machines = dict(machines)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="local-states")
        self._runs: dict[str, _Run] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        """Wait for the running executions and stop the pool."""
        self._pool.shutdown(wait=True)

    def wait(self, execution_arn: str, timeout_s: float) -> Execution:
        """The execution's end (``TimeoutError`` past ``timeout_s``)."""
        with self._lock:
            run = self._runs[execution_arn]
        return run.future.result(timeout=timeout_s)

    def executions(self) -> list[str]:
        """The ARNs of every execution started so far."""
        with self._lock:
            return list(self._runs)

    def start(self, machine_arn: str, name: str, document: str) -> str:
        """Start (or find) an execution; its ARN."""
        machine = self.machines.get(machine_arn)
        if machine is None:
            raise _Refused("StateMachineDoesNotExist", f"no state machine {machine_arn}")
        _check_start(name, document)
        parts = machine_arn.split(":")
        arn = ":".join([*parts[:5], "execution", parts[-1], name])
        with self._lock:
            found = self._runs.get(arn)
            if found is not None:
                if found.input != document or found.future.done():
                    raise _Refused("ExecutionAlreadyExists", f"Execution Already Exists: '{arn}'")
                return arn
            future = self._pool.submit(machine.run, json.loads(document), arn)
            self._runs[arn] = _Run(machine_arn, name, document, time.time(), future)
        return arn

    def describe(self, arn: str) -> dict[str, Any]:
        with self._lock:
            run = self._runs.get(arn)
        if run is None:
            raise _Refused("ExecutionDoesNotExist", f"no execution {arn}")
        answer: dict[str, Any] = {
            "executionArn": arn,
            "stateMachineArn": run.machine,
            "name": run.name,
            "status": "RUNNING",
            "startDate": run.started,
            "input": run.input,
        }
        if run.future.done():
            execution = run.future.result()
            answer["status"] = _STATUS[execution.status]
            if execution.status == "SUCCEEDED":
                answer["output"] = json.dumps(execution.output)
            else:
                answer.update(error=execution.error or "", cause=execution.cause or "")
        return answer

    def __call__(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        target = str(environ.get("HTTP_X_AMZ_TARGET", ""))
        size = int(environ.get("CONTENT_LENGTH") or 0)
        status, body = "200 OK", {}
        try:
            if size > _REQUEST_BYTES:
                raise _Refused("ValidationException", f"a {size}-byte request is too large")
            request = json.loads(environ["wsgi.input"].read(size) or b"{}")
            if target == _TARGET + "StartExecution":
                arn = self.start(
                    str(request["stateMachineArn"]),
                    str(request.get("name") or uuid.uuid4().hex),
                    str(request.get("input") or "{}"),
                )
                body = {"executionArn": arn, "startDate": time.time()}
            elif target == _TARGET + "DescribeExecution":
                body = self.describe(str(request["executionArn"]))
            else:
                raise _Refused("UnknownOperationException", f"{target[:80]} is not served")
        except _Refused as refused:
            status, body = "400 Bad Request", {"__type": refused.code, "message": refused.text}
        except (ValueError, KeyError) as exc:
            status, body = "400 Bad Request", {"__type": "ValidationException", "message": str(exc)}
        data = json.dumps(body).encode()
        start_response(status, [("content-type", _JSON), ("content-length", str(len(data)))])
        return [data]


class _Refused(Exception):
    def __init__(self, code: str, text: str) -> None:
        super().__init__(text)
        self.code, self.text = code, text
