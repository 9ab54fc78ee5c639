"""The models the OpenAI-compatible door offers: the repository's ``text_embedding`` models
whose signature maps onto ``/v1/embeddings``.

Models are the platform's, not a tenant's: every caller API Gateway lets in may use every
model (tenants differ in tier, priority, quotas and data areas, never in which models
exist), so every caller gets the same list, ``owned_by`` ``spillway``.

What the door needs of a model is in its ``config.json``: its kind, the BYTES input that
takes one text per row, the FP32 output that gives one vector per row, its size and the
most rows a request may carry (``max_batch_size``); ``created`` is when its first
committed version was (its ``SHA256SUMS``). The router reads nothing else of the
repository: no graph, no tokenizer (a request's token count comes in the answer of the
backend that ran it, ``spillway.protocol.wire.TOKEN_COUNT``).

Reads are cached ``ttl_s`` per model and for the list; a name the repository lacks is
remembered as such, at most ``CACHED_NAMES`` names, so invented names cost one read per
name and TTL. Concurrent requests for one name share one read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from spillway.protocol.errors import ModelNotFoundError, SpillwayError, UnavailableError, name_list
from spillway.protocol.names import validate_model_name

if TYPE_CHECKING:
    from spillway.models.config import ModelConfig
    from spillway.models.repository import ManagedRepository
    from spillway.models.version_files import VersionRecord

log = logging.getLogger("spillway.router")

CACHED_NAMES = 1024
"""The most model names (known or not) the catalogue remembers."""
KIND = "text_embedding"
OWNER = "spillway"
"""``owned_by`` of every model: the platform's, shared by every tenant."""
REPOSITORY_RETRY_S = 1.0
"""The ``Retry-After`` of the 503 a request gets while the repository cannot be read (a
failed read is not kept: the next request reads again)."""

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(frozen=True)
class EmbeddingModel:
    """A model as ``/v1/embeddings`` serves it: the V2 request it maps to, and its limits."""

    name: str
    text_input: str
    """The BYTES input of shape ``[-1, 1]``: one text per row."""
    output: str
    """The FP32 output of shape ``[-1, dimensions]``: one vector per row."""
    dimensions: int
    max_inputs: int
    """The most texts one request may carry: the model's ``max_batch_size``."""
    created: int
    """When the first committed version was published (epoch seconds)."""


@dataclass(frozen=True)
class Entry:
    """What the repository says of a name: the model the door offers, or why not (an
    empty ``reason``: the repository has no such model)."""

    model: EmbeddingModel | None
    reason: str = ""


def offer(config: ModelConfig, records: Callable[[], Sequence[VersionRecord]]) -> Entry:
    """The door's model for ``config``, or why the door does not serve it; its version
    ``records`` are read only for a model the door would serve."""
    name = config.name
    if config.is_pipeline:
        return Entry(None, "it is a pipeline")
    kind = config.spillway.kind
    if kind != KIND:
        return Entry(None, f"its kind is {kind}")
    text, vector = config.input[0], config.output[0]
    if len(config.input) != 1 or text.data_type != "TYPE_STRING" or tuple(text.dims) != (1,):
        return Entry(None, "it does not take one text per row")
    if vector.data_type != "TYPE_FP32" or len(vector.dims) != 1 or vector.dims[0] < 1:
        return Entry(None, "its first output is not one FP32 vector per row")
    if config.max_batch_size < 1:
        return Entry(None, "it takes no batch of texts (max_batch_size 0)")
    created = [r.created for r in records() if r.removed is None and r.created is not None]
    if not created:
        return Entry(None, "it has no committed version")
    model = EmbeddingModel(
        name, text.name, vector.name, vector.dims[0], config.max_batch_size, int(min(created))
    )
    return Entry(model)


class Expiring(Generic[K, V]):
    """Values by key, each kept for the time its read says, at most ``size`` keys (the
    least recently used go first); concurrent misses of one key share one read."""

    def __init__(self, size: int, clock: Callable[[], float]) -> None:
        self.size = size
        self.clock = clock
        self._values: OrderedDict[K, tuple[V, float]] = OrderedDict()
        self._flights: dict[K, threading.Event] = {}
        self._lock = threading.Lock()

    def get(self, key: K, read: Callable[[], tuple[V, float]]) -> V:
        """The value of ``key``, read with ``read`` (value, seconds to keep it) when it is
        missing or stale; what ``read`` raises reaches every request waiting on it."""
        while True:
            with self._lock:
                known = self._values.get(key)
                if known is not None and self.clock() < known[1]:
                    self._values.move_to_end(key)
                    return known[0]
                flight = self._flights.get(key)
                if flight is None:
                    flight = self._flights[key] = threading.Event()
                    break
            flight.wait()  # another request is reading it: its answer is this one's
            with self._lock:
                known = self._values.get(key)
            if known is not None:
                return known[0]
            # That read failed: try again (another request may be reading already).
        try:
            value, keep_s = read()
            with self._lock:
                self._values[key] = (value, self.clock() + keep_s)
                self._values.move_to_end(key)
                while len(self._values) > self.size:
                    self._values.popitem(last=False)
            return value
        finally:
            with self._lock:
                done = self._flights.pop(key)
            done.set()


class EmbeddingCatalog:
    """The ``text_embedding`` models of the repository ``locate`` says where to find (asked
    again every ``ttl_s``: a location kept in SSM may change under a warm router), opened
    with ``open`` at the first read: nothing is read while no one calls the door."""

    def __init__(
        self,
        locate: Callable[[], str],
        open_repository: Callable[[str], ManagedRepository],
        *,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._locate = locate
        self._open = open_repository
        self._opened: tuple[str, ManagedRepository] | None = None
        self.ttl_s = ttl_s
        self._location: Expiring[str, str] = Expiring(1, clock)
        self._entries: Expiring[str, Entry] = Expiring(CACHED_NAMES, clock)
        self._names: Expiring[str, tuple[str, ...]] = Expiring(1, clock)

    def model(self, name: str) -> EmbeddingModel:
        """The model ``name`` names; 404 ``model_not_found`` saying why when the door does
        not serve it (400 ``invalid_model_name`` for a name no model may have)."""
        entry = self._entry(validate_model_name(name))
        if entry.model is not None:
            return entry.model
        served = name_list(m.name for m in self.models())
        if not entry.reason:
            raise ModelNotFoundError(
                f"model {name!r} is not in the repository; /v1/embeddings serves {served}"
            )
        raise ModelNotFoundError(
            f"model {name!r} is not served at /v1/embeddings: {entry.reason}; its "
            f"text_embedding models are {served}; POST /v2/models/{name}/infer serves it"
        )

    def models(self) -> list[EmbeddingModel]:
        """Every model the door serves, by name."""
        names = self._names.get("", self._list)
        entries = (self._entry(name) for name in names)
        return [entry.model for entry in entries if entry.model is not None]

    def _entry(self, name: str) -> Entry:
        return self._entries.get(name, lambda: self._read(name))

    def _list(self) -> tuple[tuple[str, ...], float]:
        return tuple(self._reading(lambda repository: repository.list_models())), self.ttl_s

    def _read(self, name: str) -> tuple[Entry, float]:
        def read(repository: ManagedRepository) -> Entry:
            try:
                config = repository.read_config(name)
            except ModelNotFoundError:
                return Entry(None)
            return offer(config, lambda: repository.version_records(name))

        try:
            return self._reading(read), self.ttl_s
        except UnavailableError:
            raise
        except SpillwayError as exc:  # a configuration that does not validate
            log.warning("model not offered", extra={"model": name, "reason": exc.message})
            return Entry(None, "its configuration cannot be read"), self.ttl_s

    def _repository(self) -> ManagedRepository:
        """The repository where ``locate`` says it is now (opened again when it moved)."""
        location = self._location.get("", lambda: (self._locate(), self.ttl_s))
        if self._opened is None or self._opened[0] != location:
            try:
                self._opened = (location, self._open(location))
            except SpillwayError as exc:  # a location that is not a repository
                log.error("model repository not opened", extra={"reason": exc.message})
                raise UnavailableError(
                    "the model repository cannot be opened", retry_after_s=REPOSITORY_RETRY_S
                ) from None
        return self._opened[1]

    def _reading(self, read: Callable[[ManagedRepository], V]) -> V:
        """``read`` over the repository; one that cannot be reached now is a 503."""
        from spillway.aws.errors import aws_errors

        unreachable: tuple[type[Exception], ...] = (OSError, *aws_errors())
        try:
            return read(self._repository())
        except unreachable as exc:
            log.warning("model repository unreadable", extra={"reason": str(exc)[:300]})
            raise UnavailableError(
                "the model repository cannot be read now", retry_after_s=REPOSITORY_RETRY_S
            ) from None
