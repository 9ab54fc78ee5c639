"""The one request path: decode → validate → prepare → execute → encode.

Every deployable runs a request through these steps and injects only the execute step:
the GPU service passes its batcher's ``submit`` (many requests share a run), the CPU
fallback runs the engine directly (one request per run). The batch job reads records
instead of V2 bodies but validates, prepares and runs through the same engine calls.
A pipeline's request is admitted and encoded by these same steps too
(``spillway.pipelines.serving``); its step runner is what executes it.

Decoding does not need the model (a server may look the model up with the request's
``timeout`` in hand); validation and preparation do.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from spillway import tracing
from spillway.models.config import ModelConfig
from spillway.models.engine import OnnxModel
from spillway.models.processing import Prepared, Tensors, TextPrepared, outcomes
from spillway.protocol.codec import (
    binary_outputs_requested,
    decode_request,
    encode_response,
    requested_outputs,
)
from spillway.protocol.errors import DeadlineExceededError, InvalidInputError, SpillwayError
from spillway.protocol.v2 import InferenceRequest
from spillway.protocol.wire import TOKEN_COUNT, InferParameters


@dataclass(frozen=True)
class Decoded:
    """A parsed infer body: its header, one array per input and the server parameters."""

    request: InferenceRequest
    arrays: Tensors
    parameters: InferParameters


@dataclass(frozen=True)
class Admitted:
    """A request validated against its model and prepared to join a run."""

    decoded: Decoded
    prepared: Prepared
    outputs: list[str]
    binary: set[str]

    @property
    def parameters(self) -> InferParameters:
        """The request's ``timeout`` and ``priority``."""
        return self.decoded.parameters


@dataclass(frozen=True)
class Encoded:
    """An encoded infer response and the version that computed it."""

    body: bytes
    header_length: int | None
    version: int


Execute = Callable[[Admitted], Tensors]
Submit = Callable[[Admitted], Awaitable[Tensors]]
Offload = Callable[..., Awaitable[Any]]
"""Runs a blocking step (``offload(function, *args)``) off the event loop."""
Admit = Callable[[Decoded], Awaitable[Admitted]]
"""Validates and prepares one request somewhere else (e.g. together with others)."""


class Signature(Protocol):
    """What a request is admitted against: a model version, or a pipeline (whose
    ``prepare`` checks the inputs and leaves preparing to its steps)."""

    @property
    def config(self) -> ModelConfig: ...

    @property
    def output_names(self) -> Sequence[str]: ...

    def prepare(self, inputs: Tensors) -> Prepared:
        """Check ``inputs`` against the signature and pre-process them."""
        ...


def decode(body: bytes, header_length: int | None, max_body_bytes: int | None = None) -> Decoded:
    """Parse the body (JSON or binary) and the ``timeout``/``priority`` parameters."""
    request, arrays = decode_request(body, header_length, max_body_bytes=max_body_bytes)
    return Decoded(request, arrays, InferParameters.of(request.parameters))


def priority_levels(config: ModelConfig) -> int:
    """The priority levels a model (or pipeline) has: its dynamic batcher's
    ``priority_levels``; one without dynamic batching has one level."""
    batching = config.dynamic_batching
    return batching.priority_levels if config.max_batch_size > 0 and batching else 1


def check_priority(config: ModelConfig, parameters: InferParameters) -> None:
    """Refuse a ``priority`` the model has no level for (1 is the highest, 0 its default),
    with the same message on every server: out of range is the client's mistake, never
    quietly served at another level."""
    levels = priority_levels(config)
    if parameters.priority is not None and parameters.priority > levels:
        raise InvalidInputError(
            f"parameter 'priority' must be between 1 and {levels} for {config.name!r}, "
            "or 0 for its default level"
        )


def admit(model: Signature, decoded: Decoded) -> Admitted:
    """Validate against the model's signature and pre-process (e.g. tokenise)."""
    outputs, binary = _outputs(model, decoded)
    return Admitted(decoded, model.prepare(decoded.arrays), outputs, binary)


def admit_many(model: OnnxModel, decoded: Sequence[Decoded]) -> list[Admitted | SpillwayError]:
    """``admit`` over several requests with one preparation call (one tokenising pass for
    all their texts), in order; each request's error is its own and is returned."""
    wanted = outcomes(lambda request: _outputs(model, request), decoded)
    valid = [d for d, w in zip(decoded, wanted, strict=True) if not isinstance(w, SpillwayError)]
    prepared = iter(model.prepare_many([d.arrays for d in valid]))
    out: list[Admitted | SpillwayError] = []
    for request, outputs in zip(decoded, wanted, strict=True):
        if isinstance(outputs, SpillwayError):
            out.append(outputs)
            continue
        outcome = next(prepared)
        out.append(
            outcome if isinstance(outcome, SpillwayError) else Admitted(request, outcome, *outputs)
        )
    return out


def _outputs(model: Signature, decoded: Decoded) -> tuple[list[str], set[str]]:
    """The outputs a request wants, and which of them as binary data (its parameters
    checked against the model first)."""
    check_priority(model.config, decoded.parameters)
    outputs = requested_outputs(decoded.request, model.output_names)
    return outputs, binary_outputs_requested(decoded.request, outputs)


ENCODE_SPAN = "spillway.encode"
"""The span of writing a response's body (JSON, or the binary extension's tensors)."""


def encode(model: OnnxModel, admitted: Admitted, result: Tensors) -> Encoded:
    """The response body with the outputs the request asked for, in its order, and a
    text request's ``token_count``."""
    outputs = {name: result[name] for name in admitted.outputs}
    prepared = admitted.prepared
    parameters = {TOKEN_COUNT: prepared.tokens} if isinstance(prepared, TextPrepared) else None
    return encode_outputs(model.name, model.version, admitted, outputs, parameters)


def encode_outputs(
    name: str,
    version: int,
    admitted: Admitted,
    outputs: Tensors,
    parameters: dict[str, Any] | None = None,
) -> Encoded:
    """The response of version ``version`` of ``name``: ``outputs`` in their order, those
    the request asked for as binary data so, and the response ``parameters``."""
    body, length = encode_response(
        name,
        str(version),
        admitted.decoded.request.id,
        outputs,
        binary=admitted.binary & outputs.keys(),
        parameters=parameters,
    )
    return Encoded(body, length, version)


def run(model: OnnxModel, decoded: Decoded, execute: Execute) -> Encoded:
    """Validate, prepare, execute and encode, synchronously."""
    admitted = admit(model, decoded)
    result = execute(admitted)
    with tracing.span(ENCODE_SPAN):
        return encode(model, admitted, result)


async def run_async(
    model: OnnxModel,
    decoded: Decoded,
    submit: Submit,
    offload: Offload | None = None,
    prepare: Admit | None = None,
) -> Encoded:
    """Validate, prepare, execute and encode, awaiting the injected ``submit``. ``offload``
    (when given) runs preparation and encoding off the event loop; ``prepare`` (when
    given) admits the request instead, e.g. tokenised together with others."""
    if prepare is not None:
        admitted = await prepare(decoded)
    elif offload is not None:
        admitted = await offload(admit, model, decoded)
    else:  # the small-request path: no extra awaits
        admitted = admit(model, decoded)
    result = await submit(admitted)
    with tracing.span(ENCODE_SPAN):
        if offload is None:
            return encode(model, admitted, result)
        encoded: Encoded = await offload(encode, model, admitted, result)
        return encoded


def direct(
    model: OnnxModel, arrived: float, clock: Callable[[], float] = time.monotonic
) -> Execute:
    """The execute step that runs the engine on the calling thread, one request per run;
    a request whose ``timeout`` passed before it could run fails with 504 instead."""

    def execute(admitted: Admitted) -> Tensors:
        timeout_s = admitted.parameters.timeout_s
        if timeout_s is not None and clock() - arrived > timeout_s:
            raise DeadlineExceededError("the request's timeout passed before it could run")
        return model.run([admitted.prepared])[0]

    return execute
