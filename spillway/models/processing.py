"""Pre- and post-processing per model kind.

The served signature (``config.json``) is what clients send; the ONNX graph may want
something else. A processor prepares each request once, when it is admitted (validation
that the signature cannot express, tokenisation), collates prepared requests into the
graph's feeds for one run, and maps the graph's outputs back to the served outputs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer

from spillway.models.config import ModelConfig
from spillway.models.images import ImageTensors
from spillway.protocol.datatypes import numpy_dtype
from spillway.protocol.errors import InvalidInputError, ModelLoadError, SpillwayError

Tensors = dict[str, npt.NDArray[Any]]
T = TypeVar("T")
R = TypeVar("R")
Request = tuple[Tensors, int]
"""One validated request's served tensors and its row count."""


@dataclass(frozen=True)
class GraphTensor:
    """A tensor of the ONNX graph as ONNX Runtime reports it."""

    name: str
    datatype: str
    shape: tuple[int | str | None, ...]


@dataclass(frozen=True)
class Prepared:
    """One request's graph feeds, its row count and its length: what the batcher queues
    requests apart by (tokens, or a variable-width image's padded width; 0 if none)."""

    feeds: Tensors
    rows: int
    length: int = 0


def outcomes(function: Callable[[T], R], items: Iterable[T]) -> list[R | SpillwayError]:
    """``function`` over ``items``, a ``SpillwayError`` kept as that item's outcome: how
    a step over many requests lets each request fail alone."""
    out: list[R | SpillwayError] = []
    for item in items:
        try:
            out.append(function(item))
        except SpillwayError as error:
            out.append(error)
    return out


class Processor(Protocol):
    """Maps served tensors to graph feeds and graph outputs back to served tensors."""

    batched_prepare: bool
    """Whether preparing is heavy enough to run off the event loop, together with the
    requests that arrived meanwhile (tokenising, decoding images)."""

    def prepare(self, inputs: Tensors, rows: int) -> Prepared:
        """Graph feeds for one validated request; raises InvalidInputError on bad content."""

    def prepare_many(self, requests: Sequence[Request]) -> list[Prepared | SpillwayError]:
        """``prepare`` over several requests, in order; a request's error is its own."""

    def collate(self, prepared: list[Prepared]) -> Tensors:
        """The feeds of one run over several prepared requests, in order."""

    def outputs(self, graph_outputs: Tensors) -> Tensors:
        """Served outputs for the graph's outputs."""

    def sample_bytes(self, name: str, length: int) -> bytes:
        """One element for the BYTES input ``name`` that this processor accepts, for
        warming the model up (text: ``length`` words)."""

    def element_limit(self, name: str) -> int | None:
        """The longest element of the BYTES input ``name`` when the model itself bounds
        it (an encoded image: its ``max_bytes``), in place of the service's per-element
        cap; ``None``: the service's cap applies."""


def _concat(prepared: list[Prepared]) -> Tensors:
    if len(prepared) == 1:
        return prepared[0].feeds
    names = prepared[0].feeds.keys()
    return {n: np.concatenate([p.feeds[n] for p in prepared], axis=0) for n in names}


def _sample_text(length: int) -> bytes:
    return " ".join(["warm"] * length).encode()


class _OneByOne(ABC):
    """Preparing together gains nothing: ``prepare_many`` prepares each request alone."""

    batched_prepare = False

    @abstractmethod
    def prepare(self, inputs: Tensors, rows: int) -> Prepared:
        """Graph feeds for one validated request."""

    def prepare_many(self, requests: Sequence[Request]) -> list[Prepared | SpillwayError]:
        return outcomes(lambda request: self.prepare(*request), requests)

    def sample_bytes(self, name: str, length: int) -> bytes:
        return _sample_text(length)

    def element_limit(self, name: str) -> int | None:
        return None


class TensorProcessor(_OneByOne):
    """Served signature = graph signature: names and datatypes must agree at load."""

    def __init__(self, config: ModelConfig, graph_inputs: list[GraphTensor]) -> None:
        served = {t.name: t.datatype for t in config.input}
        graph = {t.name: t.datatype for t in graph_inputs}
        if served != graph:
            raise ModelLoadError(f"config inputs {served} do not match the ONNX graph's {graph}")

    def prepare(self, inputs: Tensors, rows: int) -> Prepared:
        return Prepared(inputs, rows)

    def collate(self, prepared: list[Prepared]) -> Tensors:
        return _concat(prepared)

    def outputs(self, graph_outputs: Tensors) -> Tensors:
        return graph_outputs


class ImageClassifierProcessor(_OneByOne):
    """Images ``[N, H, W]`` in; the graph takes them flattened ``[N, H*W]``."""

    def __init__(self, config: ModelConfig, graph_inputs: list[GraphTensor]) -> None:
        if len(config.input) != 1 or len(graph_inputs) != 1:
            raise ModelLoadError("an image classifier has exactly one input")
        self._served = config.input[0].name
        self._graph = graph_inputs[0].name

    def prepare(self, inputs: Tensors, rows: int) -> Prepared:
        images = inputs[self._served]
        flat = images.reshape(rows, -1).astype(np.float32, copy=False)
        return Prepared({self._graph: flat}, rows)

    def collate(self, prepared: list[Prepared]) -> Tensors:
        return _concat(prepared)

    def outputs(self, graph_outputs: Tensors) -> Tensors:
        return graph_outputs


class TextEmbeddingProcessor:
    """UTF-8 text ``[N, 1]`` in; tokenised at admission, padded to the batch's longest.

    ``prepare_many`` tokenises the texts of every request in one ``encode_batch`` call,
    which the tokenizers library spreads over its own threads without the GIL."""

    batched_prepare = True

    def __init__(self, config: ModelConfig, version_dir: Path) -> None:
        block = config.spillway
        if block.tokenizer_file is None or block.max_sequence_length is None:
            raise ModelLoadError("text_embedding models need a tokenizer and a maximum length")
        path = version_dir / block.tokenizer_file
        if not path.is_file():
            raise ModelLoadError(f"tokenizer file {block.tokenizer_file} is missing")
        self._tokenizer = Tokenizer.from_file(str(path))
        # The file may pad to a fixed length; serving pads each batch to its longest row.
        self._tokenizer.no_padding()
        self._tokenizer.enable_truncation(max_length=block.max_sequence_length)
        self._input = config.input[0].name
        self._output = config.output[0].name

    def _texts(self, inputs: Tensors) -> list[str]:
        texts = []
        for item in inputs[self._input].reshape(-1):
            try:
                text = item.decode("utf-8") if isinstance(item, bytes) else str(item)
            except UnicodeDecodeError:
                raise InvalidInputError("text must be valid UTF-8") from None
            if not text.strip():
                raise InvalidInputError("text must not be empty")
            texts.append(text)
        return texts

    def prepare(self, inputs: Tensors, rows: int) -> Prepared:
        outcome = self.prepare_many([(inputs, rows)])[0]
        if isinstance(outcome, SpillwayError):
            raise outcome
        return outcome

    def prepare_many(self, requests: Sequence[Request]) -> list[Prepared | SpillwayError]:
        texts = outcomes(self._texts, (inputs for inputs, _ in requests))
        flat = [text for t in texts if not isinstance(t, SpillwayError) for text in t]
        encodings = iter(self._tokenizer.encode_batch(flat)) if flat else iter(())
        out: list[Prepared | SpillwayError] = []
        for (_, rows), request_texts in zip(requests, texts, strict=True):
            if isinstance(request_texts, SpillwayError):
                out.append(request_texts)
            else:
                out.append(_padded([next(encodings).ids for _ in request_texts], rows))
        return out

    def collate(self, prepared: list[Prepared]) -> Tensors:
        longest = max(p.length for p in prepared)
        rows = sum(p.rows for p in prepared)
        ids = np.zeros((rows, longest), dtype=np.int64)
        mask = np.zeros((rows, longest), dtype=np.int64)
        start = 0
        for p in prepared:
            ids[start : start + p.rows, : p.length] = p.feeds["input_ids"]
            mask[start : start + p.rows, : p.length] = p.feeds["attention_mask"]
            start += p.rows
        return {"input_ids": ids, "attention_mask": mask}

    def outputs(self, graph_outputs: Tensors) -> Tensors:
        return {self._output: next(iter(graph_outputs.values()))}

    def sample_bytes(self, name: str, length: int) -> bytes:
        return _sample_text(length)

    def element_limit(self, name: str) -> int | None:
        return None


@dataclass(frozen=True)
class TextPrepared(Prepared):
    """A text request prepared, and how many tokens the model reads for it: every row's
    tokens after truncation, special tokens included, padding not. Its answer reports
    the count (``spillway.protocol.wire.TOKEN_COUNT``), so a caller billed by tokens is billed
    by this tokenising, the one the model ran, on whichever server answered."""

    tokens: int = 0


def _padded(ids: list[list[int]], rows: int) -> Prepared:
    """Token ids and mask, padded to this request's longest row (collate pads again
    across requests)."""
    length = max(len(i) for i in ids)
    padded = np.zeros((rows, length), dtype=np.int64)
    mask = np.zeros((rows, length), dtype=np.int64)
    for row, seq in enumerate(ids):
        padded[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1
    feeds = {"input_ids": padded, "attention_mask": mask}
    return TextPrepared(feeds, rows, length, tokens=sum(len(seq) for seq in ids))


class ImageProcessor(_OneByOne):
    """One encoded JPEG or PNG per row of a BYTES input in; the graph takes them decoded,
    resized and normalised into one float tensor (``spillway.image``). The request's other
    inputs pass to the graph unchanged, and the graph's outputs are the served ones.

    With a variable width, a request's rows share its widest row's width bucket (the
    request is one unit of batching: splitting it across buckets would split its answer),
    its length is that width, and a run over several widths pads to the widest."""

    # Not cheaper together, but decoding is heavy: the GPU service then prepares these
    # requests on its worker threads (Pillow decodes without the GIL), never on its loop.
    batched_prepare = True

    def __init__(self, config: ModelConfig, graph_inputs: list[GraphTensor]) -> None:
        spec = config.spillway.image
        if spec is None:
            raise ModelLoadError("an image model needs an image section")
        self._served = spec.input
        self._max_bytes = spec.max_bytes
        passed = {t.name: t.datatype for t in config.input if t.name != spec.input}
        graph = {t.name: t for t in graph_inputs}
        target = graph.get(spec.input)
        if target is None:
            rest = [t for name, t in graph.items() if name not in passed]
            target = rest[0] if len(rest) == 1 else None
        if target is None:
            raise ModelLoadError(f"no graph input takes the images of {spec.input!r}")
        others = {name: t.datatype for name, t in graph.items() if name != target.name}
        if passed != others:
            raise ModelLoadError(f"config inputs {passed} do not match the ONNX graph's {others}")
        self._graph = target.name
        self._images = ImageTensors(spec, _float_dtype(target))
        _check_image_shape(target, self._images.shape)

    def prepare(self, inputs: Tensors, rows: int) -> Prepared:
        feeds = {name: array for name, array in inputs.items() if name != self._served}
        elements = inputs[self._served].reshape(rows, -1)[:, 0]
        images = feeds[self._graph] = self._images.stack(elements, self._served)
        return Prepared(feeds, rows, self._images.width(images))

    def collate(self, prepared: list[Prepared]) -> Tensors:
        widest = max(p.length for p in prepared)
        if all(p.length == widest for p in prepared):
            return _concat(prepared)
        # Only where requests of several buckets share a run (never the GPU batcher's).
        return _concat([self._widened(p, widest) for p in prepared])

    def _widened(self, prepared: Prepared, width: int) -> Prepared:
        images = self._images.widen(prepared.feeds[self._graph], width)
        return Prepared({**prepared.feeds, self._graph: images}, prepared.rows, width)

    def outputs(self, graph_outputs: Tensors) -> Tensors:
        return graph_outputs

    def sample_bytes(self, name: str, length: int) -> bytes:
        return self._images.sample(length) if name == self._served else _sample_text(length)

    def element_limit(self, name: str) -> int | None:
        return self._max_bytes if name == self._served else None


def _float_dtype(tensor: GraphTensor) -> np.dtype[np.generic]:
    if tensor.datatype not in ("FP16", "FP32", "FP64"):
        raise ModelLoadError(f"graph input {tensor.name!r} is {tensor.datatype}, not a float type")
    return numpy_dtype(tensor.datatype)


def _check_image_shape(tensor: GraphTensor, shape: tuple[int | None, ...]) -> None:
    """The graph's own fixed dimensions must agree with the image section's, and a
    variable width (``None``) must be dynamic in the graph."""
    if len(tensor.shape) != 4 or any(
        isinstance(want, int) and want != got
        for want, got in zip(tensor.shape[1:], shape, strict=True)
    ):
        dims = ", ".join("W (dynamic)" if d is None else str(d) for d in shape)
        raise ModelLoadError(
            f"graph input {tensor.name!r} has shape {list(tensor.shape)}; "
            f"the image section makes [N, {dims}]"
        )
