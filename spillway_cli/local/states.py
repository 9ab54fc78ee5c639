"""A small local interpreter of the Amazon States Language, for the states Spillway's
state machines use, so a definition is run in tests and on the local stack, not only
linted.

It runs ``Task`` (``arn:<partition>:states:::lambda:invoke`` on local functions, or
through a boto3 Lambda client, e.g. the CPU fallback's invoke API on 127.0.0.1, and
``arn:<partition>:states:::aws-sdk:s3:putObject`` through a boto3 client, e.g. on moto),
``Succeed`` and ``Fail`` states, with ``Parameters`` (paths ``$.a.b`` and ``$$.Execution.Id``,
and the intrinsics ``States.Format`` and ``States.JsonToString``), ``ResultSelector``,
``ResultPath`` (``null``, ``$`` or ``$.a.b``), ``Retry`` (``ErrorEquals``,
``IntervalSeconds``, ``MaxAttempts``, ``BackoffRate``) and ``Catch`` as Step Functions
does. Anything else in a definition is refused when it is loaded, so a definition cannot
lean on a feature this interpreter would silently get wrong.

A Lambda function that raises fails its task with the exception's class name as the
error and ``{"errorMessage", "errorType"}`` as the cause, as the Lambda integration
reports them. A state whose input (after ``Parameters``), task result or output is larger
than ``spillway.aws.limits.SFN_PAYLOAD_BYTES`` fails the execution with
``States.DataLimitExceeded``, a terminal error that no retrier or catcher takes
(https://docs.aws.amazon.com/step-functions/latest/dg/concepts-error-handling.html).

The ``step_functions`` module serves executions of it over Step Functions' API.
"""

from __future__ import annotations

import copy
import json
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from spillway.aws.limits import SFN_PAYLOAD_BYTES

PARTITIONS = ("aws", "aws-cn", "aws-us-gov")
_PARTITION = "(" + "|".join(re.escape(p) for p in PARTITIONS) + ")"
LAMBDA_INVOKE = re.compile(rf"^arn:{_PARTITION}:states:::lambda:invoke$")
S3_PUT_OBJECT = re.compile(rf"^arn:{_PARTITION}:states:::aws-sdk:s3:putObject$")
_FIELDS = {
    "Task": {
        "Type",
        "Comment",
        "Resource",
        "Parameters",
        "ResultSelector",
        "ResultPath",
        "Retry",
        "Catch",
        "Next",
        "End",
    },
    "Succeed": {"Type", "Comment"},
    "Fail": {"Type", "Comment", "Error", "Cause"},
}
_RETRIER = {"ErrorEquals", "IntervalSeconds", "MaxAttempts", "BackoffRate"}
_CATCHER = {"ErrorEquals", "ResultPath", "Next"}
_INTRINSIC = re.compile(r"^(States\.[A-Za-z]+)\((.*)\)$", re.DOTALL)
_ARGUMENT = re.compile(r"\s*('(?:[^'\\]|\\.)*'|\$[^,]*)\s*(?:,|$)")

Function = Callable[[dict[str, Any]], Any]
DATA_LIMIT = "States.DataLimitExceeded"
_TERMINAL = frozenset({"States.Runtime", DATA_LIMIT})
"""Errors that fail the execution whatever its retriers and catchers say."""


class DefinitionError(ValueError):
    """The definition uses something this interpreter does not run."""


class StatesError(Exception):
    """A state failed with a Step Functions error name and cause."""

    def __init__(self, name: str, cause: str = "") -> None:
        super().__init__(f"{name}: {cause}")
        self.name = name
        self.cause = cause


@dataclass
class Execution:
    """How an execution ended, and what happened on the way."""

    status: Literal["SUCCEEDED", "FAILED"]
    output: Any = None
    error: str | None = None
    cause: str | None = None
    history: list[tuple[str, str]] = field(default_factory=list)
    """``(state, event)``: ``entered``, ``retry <n> after <error>``, ``caught <error>``,
    ``failed <error>``, ``succeeded``."""


def _path(document: Any, path: str, context: Mapping[str, Any]) -> Any:
    """The value at a path: ``$``, ``$.a.b`` or ``$$.Execution.Id``."""
    root, rest = (context, path[2:]) if path.startswith("$$") else (document, path[1:])
    value = root
    for part in [p for p in rest.split(".") if p]:
        if not isinstance(value, dict) or part not in value:
            raise StatesError("States.Runtime", f"the path {path} is not in the input")
        value = value[part]
    return value


def _intrinsic(expression: str, document: Any, context: Mapping[str, Any]) -> Any:
    match = _INTRINSIC.match(expression.strip())
    if match is None:
        raise DefinitionError(f"not an intrinsic function: {expression}")
    name, raw = match.groups()
    args: list[Any] = []
    for literal in _ARGUMENT.findall(raw):
        if literal.startswith("'"):
            args.append(literal[1:-1].replace("\\'", "'"))
        else:
            args.append(_path(document, literal.strip(), context))
    if name == "States.Format":
        template, values = args[0], iter(args[1:])
        return re.sub(r"\{\}", lambda _: str(next(values)), template)
    if name == "States.JsonToString" and len(args) == 1:
        return json.dumps(args[0], separators=(",", ":"))
    raise DefinitionError(f"the intrinsic {name} is not run locally")


def _fill(template: Any, document: Any, context: Mapping[str, Any]) -> Any:
    """``Parameters`` or ``ResultSelector`` with every ``key.$`` taken from the document."""
    if isinstance(template, dict):
        out: dict[str, Any] = {}
        for key, value in template.items():
            if key.endswith(".$"):
                text = str(value)
                found = (
                    _path(document, text, context)
                    if text.startswith("$")
                    else _intrinsic(text, document, context)
                )
                out[key[:-2]] = copy.deepcopy(found)
            else:
                out[key] = _fill(value, document, context)
        return out
    if isinstance(template, list):
        return [_fill(item, document, context) for item in template]
    return template


def _place(document: Any, result: Any, path: str | None) -> Any:
    """``ResultPath``: the input with the result at ``path`` (``None``: the input)."""
    if path is None:
        return document
    if path == "$":
        return result
    out = copy.deepcopy(document) if isinstance(document, dict) else {}
    target = out
    parts = path[2:].split(".")
    for part in parts[:-1]:
        target = target.setdefault(part, {})
    target[parts[-1]] = result
    return out


def _within_limit(value: Any, what: str) -> Any:
    """``value``, unless its JSON (UTF-8, compact) is larger than a state's data may be:
    ``States.DataLimitExceeded``."""
    size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
    if size > SFN_PAYLOAD_BYTES:
        raise StatesError(
            DATA_LIMIT, f"the {what} ({size} bytes) is larger than {SFN_PAYLOAD_BYTES} bytes"
        )
    return value


def _matches(names: list[str], error: str) -> bool:
    if error in _TERMINAL:
        return False
    if "States.ALL" in names or error in names:
        return True
    return "States.TaskFailed" in names and error != "States.Timeout"


class LocalStateMachine:
    """Runs a definition with local Lambda functions (by ARN) and an S3 client."""

    def __init__(
        self,
        definition: Mapping[str, Any],
        *,
        functions: Mapping[str, Function],
        s3: Any | None = None,
        sleep: Callable[[float], None] = time.sleep,
        lambda_client: Any | None = None,
    ) -> None:
        self.definition = definition
        self.functions = functions
        self.s3 = s3
        self.sleep = sleep
        self.lambda_client = lambda_client
        """Invokes a function that ``functions`` does not hold, as Step Functions would."""
        self._check()

    def _check(self) -> None:
        states = self.definition.get("States", {})
        if self.definition.get("StartAt") not in states:
            raise DefinitionError("StartAt names no state")
        unknown = set(self.definition) - {"Comment", "StartAt", "States"}
        if unknown:
            raise DefinitionError(f"top-level fields not run locally: {sorted(unknown)}")
        for name, state in states.items():
            kind = state.get("Type")
            extra = set(state) - _FIELDS.get(kind, set())
            if kind not in _FIELDS or extra:
                raise DefinitionError(f"state {name}: {kind} with {sorted(extra)} is not run")
            if kind == "Task" and not _known_resource(str(state["Resource"])):
                raise DefinitionError(f"state {name}: resource {state['Resource']} is not run")
            for retrier in state.get("Retry", []):
                if set(retrier) - _RETRIER:
                    raise DefinitionError(f"state {name}: retrier fields {sorted(retrier)}")
            for catcher in state.get("Catch", []):
                if set(catcher) - _CATCHER or catcher["Next"] not in states:
                    raise DefinitionError(f"state {name}: catcher {catcher}")
            if kind == "Task" and state.get("Next") not in states and not state.get("End"):
                raise DefinitionError(f"state {name}: Next names no state")

    def run(self, document: Any, execution_id: str | None = None) -> Execution:
        """Run an execution with ``document`` as its input."""
        context = {"Execution": {"Id": execution_id or uuid.uuid4().hex, "Input": document}}
        execution = Execution("FAILED")
        name: str = self.definition["StartAt"]
        while True:
            state = self.definition["States"][name]
            execution.history.append((name, "entered"))
            if state["Type"] == "Succeed":
                execution.status, execution.output = "SUCCEEDED", document
                execution.history.append((name, "succeeded"))
                return execution
            if state["Type"] == "Fail":
                execution.error, execution.cause = state.get("Error"), state.get("Cause")
                execution.history.append((name, f"failed {execution.error}"))
                return execution
            try:
                result = self._attempts(name, state, document, context, execution)
            except StatesError as error:
                catcher = next(
                    (c for c in state.get("Catch", []) if _matches(c["ErrorEquals"], error.name)),
                    None,
                )
                if catcher is None:
                    return _failed(execution, name, error)
                execution.history.append((name, f"caught {error.name}"))
                failure = {"Error": error.name, "Cause": error.cause}
                document = _place(document, failure, catcher.get("ResultPath", "$"))
                name = catcher["Next"]
                continue
            try:
                document = _within_limit(
                    _place(document, result, state.get("ResultPath", "$")), "state's output"
                )
            except StatesError as error:
                return _failed(execution, name, error)
            if state.get("End"):
                execution.status, execution.output = "SUCCEEDED", document
                return execution
            name = state["Next"]

    def _attempts(
        self,
        name: str,
        state: Mapping[str, Any],
        document: Any,
        context: Mapping[str, Any],
        execution: Execution,
    ) -> Any:
        """The task's result, retried as its retriers say."""
        tries = [0] * len(state.get("Retry", []))
        while True:
            try:
                parameters = _fill(state.get("Parameters", document), document, context)
                raw = self._task(state, _within_limit(parameters, "state's input"))
                _within_limit(raw, "task's result")
                return (
                    _fill(state["ResultSelector"], raw, context)
                    if "ResultSelector" in state
                    else raw
                )
            except StatesError as error:
                retriers = list(enumerate(state.get("Retry", [])))
                found = next(
                    ((i, r) for i, r in retriers if _matches(r["ErrorEquals"], error.name)), None
                )
                if found is None:
                    raise
                index, retrier = found
                if tries[index] >= retrier.get("MaxAttempts", 3):
                    raise
                wait = (
                    retrier.get("IntervalSeconds", 1)
                    * retrier.get("BackoffRate", 2.0) ** tries[index]
                )
                tries[index] += 1
                execution.history.append((name, f"retry {tries[index]} after {error.name}"))
                self.sleep(wait)

    def _task(self, state: Mapping[str, Any], parameters: Any) -> Any:
        if LAMBDA_INVOKE.match(str(state["Resource"])):
            return self._invoke(parameters)
        return self._put_object(parameters)

    def _invoke(self, parameters: Mapping[str, Any]) -> Any:
        name = str(parameters.get("FunctionName"))
        function = self.functions.get(name)
        payload = json.loads(json.dumps(parameters.get("Payload", {})))  # as it travels
        if function is None and self.lambda_client is not None:
            return self._invoke_remote(name, payload)
        if function is None:
            raise StatesError("Lambda.ResourceNotFoundException", name)
        try:
            answer = function(payload)
        except Exception as exc:  # every failure of the function is the task's error
            kind = type(exc).__name__
            raise StatesError(
                kind, json.dumps({"errorMessage": str(exc), "errorType": kind})
            ) from exc
        return {
            "ExecutedVersion": "$LATEST",
            "Payload": json.loads(json.dumps(answer)),
            "StatusCode": 200,
        }

    def _invoke_remote(self, name: str, payload: Any) -> Any:
        """Invoke through Lambda's API: a function error fails the task with its
        ``errorType``, the service's own errors as ``Lambda.<code>``."""
        from spillway.aws.errors import BotoCoreError, ClientError, error_code

        assert self.lambda_client is not None  # noqa: S101 - checked by the caller
        try:
            answer = self.lambda_client.invoke(FunctionName=name, Payload=json.dumps(payload))
        except ClientError as exc:
            code = error_code(exc, "AWSLambdaException")
            raise StatesError(f"Lambda.{code}", str(exc)) from exc
        except BotoCoreError as exc:
            raise StatesError("Lambda.SdkClientException", str(exc)) from exc
        text = answer["Payload"].read().decode()
        if answer.get("FunctionError"):
            kind = str(json.loads(text or "{}").get("errorType", "Lambda.Unknown"))
            raise StatesError(kind, text)
        return {
            "ExecutedVersion": "$LATEST",
            "Payload": json.loads(text or "null"),
            "StatusCode": 200,
        }

    def _put_object(self, parameters: Mapping[str, Any]) -> Any:
        from spillway.aws.errors import ClientError, error_code

        if self.s3 is None:
            raise StatesError("S3.S3Exception", "no S3 client is configured")
        body = parameters.get("Body", "")
        try:
            answer = self.s3.put_object(
                Bucket=parameters["Bucket"],
                Key=parameters["Key"],
                Body=body.encode() if isinstance(body, str) else body,
                **(
                    {"ContentType": parameters["ContentType"]}
                    if "ContentType" in parameters
                    else {}
                ),
            )
        except ClientError as exc:
            code = error_code(exc, "S3Exception")
            raise StatesError(f"S3.{code}", str(exc)) from exc
        return {"ETag": answer.get("ETag")}


def _failed(execution: Execution, state: str, error: StatesError) -> Execution:
    """The execution, failed in ``state`` with ``error``."""
    execution.error, execution.cause = error.name, error.cause
    execution.history.append((state, f"failed {error.name}"))
    return execution


def _known_resource(resource: str) -> bool:
    return bool(LAMBDA_INVOKE.match(resource) or S3_PUT_OBJECT.match(resource))


def substituted(definition: Mapping[str, Any], values: Mapping[str, str]) -> dict[str, Any]:
    """The definition with ``${Name}`` replaced as CloudFormation's
    ``DefinitionSubstitutions`` replace them."""
    text = json.dumps(definition)
    for name, value in values.items():
        text = text.replace("${" + name + "}", value)
    if re.search(r"\$\{[A-Za-z0-9]+\}", text):
        raise DefinitionError("a substitution is left unset")
    result: dict[str, Any] = json.loads(text)
    return result
