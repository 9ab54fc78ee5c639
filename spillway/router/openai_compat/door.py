"""The OpenAI-compatible door: ``POST /v1/embeddings``, ``GET /v1/models[/{id}]``.

An embeddings request becomes the V2 infer request of its texts on the same model
(``schema.v2_request``) and goes through ``Router.route`` like any other: the same
tenant (the one API Gateway vouched for), policy rules (its path is
``/v2/models/{m}/infer``), deadline, canary arm, fallback chain, circuit breakers,
accounting and ``x-spillway-*`` headers. The only difference is ``at_once``: it is
answered with vectors, never a job id, so the async and batch modes are refused and a
rule routing to batch walks its chain without it. The backend's answer carries the
vectors and the token count of the tokenising that ran (``TOKEN_COUNT``), which become
OpenAI's shape; every failure, the door's own or a backend's, leaves in OpenAI's error
shape (``errors.openai_reply``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TypeVar

from spillway.policy.facts import Call
from spillway.protocol.errors import (
    BatchTooLargeError,
    InferenceError,
    InvalidInputError,
    ModelNotFoundError,
    NotConfiguredError,
)
from spillway.protocol.framing import HEADER_LENGTH, JSON_CONTENT_TYPE
from spillway.protocol.replies import Reply, guarded, json_reply
from spillway.protocol.wire import Target, allow
from spillway.router.dispatch import Router
from spillway.router.openai_compat.catalog import EmbeddingCatalog, EmbeddingModel
from spillway.router.openai_compat.errors import openai_reply
from spillway.router.openai_compat.schema import (
    EmbeddingsRequest,
    FieldRefused,
    embeddings_body,
    model_object,
    models_body,
    read_answer,
    read_request,
    v2_request,
)

log = logging.getLogger("spillway.router")

EMBEDDINGS = "/v1/embeddings"
MODELS = "/v1/models"
_NOT_SENT = frozenset({HEADER_LENGTH, "content-type", "content-length"})
"""Client headers the V2 request does not carry: its body is JSON the door wrote."""
_NOT_ANSWERED = frozenset({"content-type", "content-length"})
T = TypeVar("T")


def serves(path: str) -> bool:
    """Whether ``path`` is one of the door's."""
    return path in (EMBEDDINGS, MODELS) or path.startswith(f"{MODELS}/")


class OpenAIDoor:
    """The OpenAI-compatible paths over ``router``; ``catalog`` says which models there
    are (``None``: no repository configured, the paths answer 400 ``not_configured``, as
    session state does without its table)."""

    def __init__(self, router: Router, catalog: EmbeddingCatalog | None) -> None:
        self.router = router
        self.catalog = catalog

    def answer(
        self, method: str, path: str, call: Callable[[], Call], where: Mapping[str, object]
    ) -> Reply:
        """The reply to one request on the door's paths, always in OpenAI's shape; a
        refusal is logged once, as on every door (``where``: the request id)."""
        param: str | None = None

        def route() -> Reply:
            nonlocal param
            try:
                return self._route(method, path, call)
            except FieldRefused as refused:
                param = refused.param
                raise refused.error from None

        reply = guarded(log, route, method=method[:16], path=path[:200], **where)
        return openai_reply(reply, param)

    def _route(self, method: str, path: str, call: Callable[[], Call]) -> Reply:
        catalog = self.catalog
        if catalog is None:
            raise NotConfiguredError(
                f"{path[:200]} is not offered by this deployment (neither "
                "ROUTER_MODEL_REPOSITORY nor ROUTER_MODEL_REPOSITORY_PARAMETER is set)"
            )
        if path == EMBEDDINGS:
            allow(method, path, "POST")
            return self._embeddings(catalog, call())
        allow(method, path, "GET")
        if path == MODELS:
            return json_reply(200, models_body(catalog.models()))
        name = path[len(MODELS) + 1 :]
        return json_reply(200, model_object(_field("model", lambda: catalog.model(name))))

    def _embeddings(self, catalog: EmbeddingCatalog, call: Call) -> Reply:
        request = read_request(call.body)
        model = _field("model", lambda: catalog.model(request.model))
        _check_fits(request, model)
        texts = request.input
        headers = {k: v for k, v in call.headers.items() if k not in _NOT_SENT}
        headers["content-type"] = JSON_CONTENT_TYPE
        sent = Call(
            method="POST",
            headers=headers,
            body=v2_request(model, texts),
            request_id=call.request_id,
            remaining_ms=call.remaining_ms,
            trusted_tenant=call.trusted_tenant,
        )
        reply = self.router.route(sent, Target("infer", model.name), at_once=True)
        if reply.status >= 400:
            return reply  # the walk's error or a backend's: openai_reply rewrites it
        if reply.status != 200:
            raise InferenceError(f"the backend answered {reply.status} without vectors")
        vectors, tokens = read_answer(reply.body, model, len(texts))
        body = embeddings_body(request.model, vectors, request.encoding_format, tokens)
        kept = [(k, v) for k, v in reply.headers if k not in _NOT_ANSWERED]
        return json_reply(200, body, kept)


def _check_fits(request: EmbeddingsRequest, model: EmbeddingModel) -> None:
    """The request within what ``model`` takes: at most ``max_batch_size`` texts, and
    ``dimensions`` (when given) its own size. A shorter vector is not offered: the
    models served here (mean-pooled, L2-normalised) were not trained so that a prefix of
    their vector is an embedding too, so a cut vector would rank differently."""
    if len(request.input) > model.max_inputs:
        raise FieldRefused(
            "input",
            BatchTooLargeError(
                f"{len(request.input)} texts exceed the {model.max_inputs} that model "
                f"{model.name!r} takes in one request (its max_batch_size)"
            ),
        )
    if request.dimensions is not None and request.dimensions != model.dimensions:
        raise FieldRefused(
            "dimensions",
            InvalidInputError(
                f"dimensions {request.dimensions} is not offered: model {model.name!r} "
                f"gives {model.dimensions}-dimensional vectors and is not trained for "
                "shorter ones (omit dimensions, or send its own size)"
            ),
        )


def _field(param: str, read: Callable[[], T]) -> T:
    """``read()``; a bad or unknown name it refuses names the request field ``param``
    (OpenAI's ``param``)."""
    try:
        return read()
    except (InvalidInputError, ModelNotFoundError) as exc:
        raise FieldRefused(param, exc) from None
