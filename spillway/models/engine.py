"""The inference engine: one ONNX Runtime session per model version.

Every input is validated against the served signature before it may join a batch; a
request that passes validation cannot make a batch fail for the others. The execution
provider comes from options (CUDA then CPU on the GPU image); when CUDA was asked for and
the session came up on the CPU, the engine says so in the log and in the metadata.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnxruntime as ort

from spillway.models.config import ModelConfig, TensorConfig
from spillway.models.kinds import make_processor
from spillway.models.processing import (
    GraphTensor,
    Prepared,
    Processor,
    Tensors,
    outcomes,
)
from spillway.protocol.datatypes import datatype_of, from_onnx_type, numpy_dtype
from spillway.protocol.errors import (
    BatchTooLargeError,
    InferenceError,
    InvalidInputError,
    ModelLoadError,
    PayloadTooLargeError,
    SpillwayError,
    name_list,
)
from spillway.protocol.tensors import check_finite
from spillway.protocol.v2 import MetadataModelResponse, MetadataTensor

log = logging.getLogger("spillway.engine")

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
_OPT_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


@dataclass(frozen=True)
class EngineOptions:
    """How sessions are built and what one request may carry."""

    providers: tuple[str, ...] = (CPU,)
    intra_op_threads: int = 0
    inter_op_threads: int = 0
    wide_threads: int = 0
    """Intra-op threads of a second session for the runs that have the device to
    themselves (0, or no more than ``intra_op_threads``: none): a lone request computes on
    every core while concurrent ones each take one (the GPU service's compute budget)."""
    graph_optimization: Literal["disable", "basic", "extended", "all"] = "all"
    max_elements_per_input: int = 16 * 1024 * 1024
    max_bytes_per_element: int = 64 * 1024


def _session(path: Path, options: EngineOptions) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = options.intra_op_threads
    so.inter_op_num_threads = options.inter_op_threads
    so.graph_optimization_level = _OPT_LEVELS[options.graph_optimization]
    available = set(ort.get_available_providers())
    providers = [p for p in options.providers if p in available] or [CPU]
    try:
        return ort.InferenceSession(str(path), sess_options=so, providers=providers)
    except Exception as exc:
        raise ModelLoadError(f"ONNX Runtime could not load {path.name}: {exc}") from exc


def _graph_tensors(args: list[Any]) -> list[GraphTensor]:
    return [GraphTensor(a.name, from_onnx_type(a.type), tuple(a.shape)) for a in args]


class OnnxModel:
    """A loaded model version: validation, preparation and batched runs."""

    def __init__(
        self,
        name: str,
        version: int,
        config: ModelConfig,
        version_dir: Path,
        options: EngineOptions,
    ) -> None:
        self.name = name
        self.version = version
        self.config = config
        self.options = options
        self.session = _session(version_dir / config.spillway.onnx_file, options)
        self._wide: ort.InferenceSession | None = None
        if options.wide_threads > max(options.intra_op_threads, 1):
            wide = replace(options, intra_op_threads=options.wide_threads)
            self._wide = _session(version_dir / config.spillway.onnx_file, wide)
        self.provider = self.session.get_providers()[0]
        self.provider_fallback = CUDA in options.providers and self.provider != CUDA
        if self.provider_fallback:
            log.warning(
                "CUDA was requested for %s v%d but the session runs on %s",
                name,
                version,
                self.provider,
            )
        self._inputs = {t.name: t for t in config.input}
        lead = (-1,) if self.batching else ()
        self._dims = {t.name: (*lead, *t.dims) for t in config.input}
        self._non_finite = frozenset(config.spillway.non_finite_inputs)
        self._output_names = [o.name for o in self.session.get_outputs()]
        self.output_names = [o.name for o in config.output]
        """The served outputs, in the configuration's order."""
        self.processor: Processor = make_processor(
            config, version_dir, _graph_tensors(self.session.get_inputs())
        )

    @property
    def batching(self) -> bool:
        """Whether the first dimension of every tensor is the batch dimension."""
        return self.config.max_batch_size > 0

    def validate(self, inputs: Tensors) -> int:
        """Check names, datatypes, shapes and caps; the request's row count."""
        if inputs.keys() != self._inputs.keys():
            unknown = inputs.keys() - self._inputs.keys()
            if unknown:
                name = sorted(unknown)[0]
                raise InvalidInputError(
                    f"unknown input {name!r} for model {self.name}; {self._input_names}"
                )
            missing = sorted(self._inputs.keys() - inputs.keys())[0]
            raise InvalidInputError(
                f"missing input {missing!r} for model {self.name}; {self._input_names}"
            )
        rows = [self._check_tensor(self._inputs[n], a) for n, a in inputs.items()]
        count = rows[0]
        if rows.count(count) != len(rows):
            raise InvalidInputError("all inputs must have the same batch size")
        if self.batching and count > self.config.max_batch_size:
            raise BatchTooLargeError(
                f"batch of {count} exceeds max_batch_size {self.config.max_batch_size}"
            )
        return count

    @property
    def _input_names(self) -> str:
        return f"its inputs: {name_list(self._inputs)}"

    def _check_tensor(self, spec: TensorConfig, array: np.ndarray) -> int:
        datatype = datatype_of(array)
        if datatype != spec.datatype:
            raise InvalidInputError(f"input {spec.name!r} must be {spec.datatype}, got {datatype}")
        dims = self._dims[spec.name]
        if array.ndim != len(dims) or any(
            want not in (-1, got) for want, got in zip(dims, array.shape, strict=True)
        ):
            raise InvalidInputError(
                f"input {spec.name!r} must have shape {list(dims)}, got {list(array.shape)}"
            )
        if array.size > self.options.max_elements_per_input:
            raise PayloadTooLargeError(f"input {spec.name!r} has too many elements")
        if datatype.startswith("FP") and spec.name not in self._non_finite:
            check_finite(spec.name, array)
        limit = self.processor.element_limit(spec.name) or self.options.max_bytes_per_element
        if datatype == "BYTES" and any(len(x) > limit for x in array.reshape(-1)):
            raise PayloadTooLargeError(f"an element of input {spec.name!r} is too long")
        rows = array.shape[0] if self.batching else 1
        if rows < 1:
            raise InvalidInputError(f"input {spec.name!r} has an empty batch")
        return int(rows)

    @property
    def batched_prepare(self) -> bool:
        """Whether preparing requests together beats one by one (text: one tokenising
        call for many requests)."""
        return self.processor.batched_prepare

    def prepare(self, inputs: Tensors) -> Prepared:
        """Validate and pre-process one request, ready to join a batch."""
        return self.processor.prepare(inputs, self.validate(inputs))

    def prepare_many(self, requests: Sequence[Tensors]) -> list[Prepared | SpillwayError]:
        """``prepare`` over several requests in one processor call, in order; each
        request's error (validation or content) is its own and is returned, not raised."""
        checked = outcomes(lambda inputs: (inputs, self.validate(inputs)), requests)
        valid = [c for c in checked if not isinstance(c, SpillwayError)]
        prepared = iter(self.processor.prepare_many(valid))
        return [c if isinstance(c, SpillwayError) else next(prepared) for c in checked]

    @property
    def wide(self) -> bool:
        """Whether it has a session for runs that have the device to themselves."""
        return self._wide is not None

    def run(self, batch: list[Prepared], wide: bool = False) -> list[Tensors]:
        """One ONNX Runtime run over prepared requests; each gets exactly its rows back.
        ``wide``: on the session with ``wide_threads`` (when it has one)."""
        feeds = self.processor.collate(batch)
        session = self._wide if wide and self._wide is not None else self.session
        try:
            raw = session.run(self._output_names, feeds)
        except Exception as exc:
            raise InferenceError(f"model {self.name} failed: {exc}") from exc
        outputs = self.processor.outputs(dict(zip(self._output_names, raw, strict=True)))
        if not self.batching:
            return [outputs]
        total = sum(p.rows for p in batch)
        for name, array in outputs.items():
            if array.shape[:1] != (total,):
                raise InferenceError(f"output {name!r} has {array.shape[:1]} rows, not {total}")
        results, start = [], 0
        for p in batch:
            results.append({n: a[start : start + p.rows] for n, a in outputs.items()})
            start += p.rows
        return results

    def infer(self, inputs: Tensors) -> Tensors:
        """Validate, prepare and run a single request (no batching)."""
        return self.run([self.prepare(inputs)])[0]

    def metadata(self) -> dict[str, Any]:
        """The Open Inference Protocol model metadata (leading -1 when batching)."""
        meta = config_metadata(self.config, [self.version])
        meta["parameters"] = {
            "execution_provider": self.provider,
            "provider_fallback": self.provider_fallback,
        }
        return meta

    def sample_inputs(self, rows: int, length: int = 8) -> Tensors:
        """Inputs generated from the signature, for warm-up (BYTES: an element the
        processor accepts, e.g. ``length`` words or an image)."""
        rng = np.random.default_rng(0)
        samples: Tensors = {}
        for spec in self.config.input:
            shape = [rows] if self.batching else []
            shape += [d if d > 0 else 1 for d in spec.dims]
            if spec.datatype == "BYTES":
                element = self.processor.sample_bytes(spec.name, length)
                samples[spec.name] = np.full(shape, element, dtype=np.object_)
            else:
                values = rng.random(math.prod(shape)).reshape(shape)
                samples[spec.name] = values.astype(numpy_dtype(spec.datatype))
        return samples


def config_metadata(config: ModelConfig, versions: list[int]) -> dict[str, Any]:
    """Model metadata from the configuration alone (a model need not be loaded)."""
    lead = [-1] if config.max_batch_size > 0 else []

    def tensors(specs: tuple[TensorConfig, ...]) -> list[MetadataTensor]:
        return [
            MetadataTensor(name=t.name, datatype=t.datatype, shape=[*lead, *t.dims]) for t in specs
        ]

    # Built through the protocol's response model so what we serve is what the spec says.
    document = MetadataModelResponse(
        name=config.name,
        versions=[str(v) for v in versions],
        platform=config.platform,
        inputs=tensors(config.input),
        outputs=tensors(config.output),
    )
    return document.model_dump(exclude_none=True)
