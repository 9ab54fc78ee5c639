"""A model, or a new version of one, from its ONNX file: planned against what the name
serves now, proven, published.

``plan_version`` reads the file and writes nothing. A new name gets the configuration its
graph and the options make (``spillway.models.onboarding``: text, image or tensor; batching
from the proof and the profile). A new version of a name keeps the configuration served now
(kind, processing, batching, the proof still run) when the file keeps its signature: the
tensors callers see under that configuration (``signature.refit``) are the ones they see
now. Otherwise ``differences`` lists what callers would find changed, and ``add_model``
refuses it unless told to replace the signature; replacing it keeps the outgoing
configuration for the versions served under it (``lineage.keep_outgoing``), so that a
rollback serves them as they were.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from spillway.models.config import ModelConfig
from spillway.models.engine import EngineOptions, OnnxModel
from spillway.models.lineage import for_new_version, keep_outgoing, served_now
from spillway.models.loader import load_version
from spillway.models.onboarding import (
    DEFAULT_SEQUENCE_LENGTH,
    PROFILE_BATCHES,
    BatchProof,
    ProfileRow,
    Proposal,
    configure,
    profile,
    propose,
    prove_batching,
    text_config,
    tokenizer_max_length,
)
from spillway.models.repository import LocalRepository, ManagedRepository, ModelRepository
from spillway.models.signature import (
    GraphSignature,
    ImageOptions,
    config_from_signature,
    image_config,
    read_signature,
    refit,
    signature_differences,
)
from spillway.protocol.errors import InvalidInputError, ModelLoadError


@dataclass(frozen=True)
class Added:
    """What ``add_model`` wrote, and the evidence it chose the configuration from."""

    config: ModelConfig
    version: int
    location: str
    proof: BatchProof | None
    """``None`` where the graph has no dynamic batch dimension (nothing to prove)."""
    profile: tuple[ProfileRow, ...] = ()
    proposal: Proposal | None = None
    notes: tuple[str, ...] = field(default=())
    kept: bool = False
    """Whether the name's served configuration was kept (no profile, no new batching)."""


@dataclass(frozen=True)
class VersionPlan:
    """What ``add_model`` is to publish for a file, decided before anything is written:
    a new name's configuration comes from the graph and the options; a new version of a
    name keeps the configuration served now (kind, processing, batching) when the file
    keeps its signature, else it differs from it in ``differences``."""

    name: str
    source: Path
    tokenizer: Path | None
    draft: ModelConfig
    """The file's configuration as a new model: what ``--replace-signature`` publishes."""
    served: ModelConfig | None = None
    """The name's configuration now; ``None`` for a new name."""
    served_versions: tuple[int, ...] = ()
    kept: ModelConfig | None = None
    """``served``, when the file keeps its signature."""
    differences: tuple[str, ...] = ()
    """What callers of the name would find changed, served -> ``draft``."""

    def refusal(self) -> str:
        """One line: why the file is not published under the name as it is."""
        served = ", ".join(f"v{v}" for v in self.served_versions) or "no version"
        return (
            f"{self.source.name} does not keep the signature of {self.name} (served: "
            f"{served}): {'; '.join(self.differences)}. Nothing was written; "
            "--replace-signature publishes it with its own signature"
        )


def plan_version(
    repository: ModelRepository,
    name: str,
    onnx_file: Path,
    *,
    tokenizer: Path | None = None,
    max_sequence_length: int | None = None,
    image: ImageOptions | None = None,
) -> VersionPlan:
    """Read ``onnx_file`` (a text model with ``tokenizer``, an image model with
    ``image``) and compare it with what ``name`` serves now; writes nothing."""
    signature = read_signature(onnx_file)
    draft = draft_config(name, signature, tokenizer, max_sequence_length, image)
    found = served_now(repository, name)
    if found is None:
        return VersionPlan(name, onnx_file, tokenizer, draft)
    served, versions = found
    try:
        given = tokenizer is not None or image is not None
        changed = signature_differences(served, draft if given else refit(served, signature))
    except ModelLoadError as exc:  # the served kind cannot take this graph
        changed = [exc.message]
    plan = VersionPlan(name, onnx_file, tokenizer, draft, served, tuple(versions))
    if not changed:
        return replace(plan, kept=served)
    # Listed as what --replace-signature would publish; else why the served one cannot stay.
    return replace(plan, differences=tuple(signature_differences(served, draft) or changed))


def draft_config(
    name: str,
    signature: GraphSignature,
    tokenizer: Path | None,
    max_sequence_length: int | None,
    image: ImageOptions | None,
) -> ModelConfig:
    """A new model's configuration from its graph: a text model with ``tokenizer``, an
    image model with ``image``, else a tensor model; ``max_batch_size`` the largest
    profiled batch, for the proof to narrow."""
    limit = max(PROFILE_BATCHES)
    if tokenizer is not None and image is not None:
        raise ModelLoadError("a model is a text model (a tokenizer) or an image model, not both")
    if tokenizer is not None:
        length = max_sequence_length or tokenizer_max_length(tokenizer) or DEFAULT_SEQUENCE_LENGTH
        return text_config(name, signature, length, limit)
    if image is not None:
        return image_config(name, signature, image, max_batch_size=limit)
    return config_from_signature(name, signature, max_batch_size=limit)


def add_model(
    repository: ManagedRepository,
    plan: VersionPlan,
    *,
    version: int | None = None,
    p99_ms: float = 50.0,
    options: EngineOptions | None = None,
    replace_signature: bool = False,
) -> Added:
    """Prove and publish ``plan``'s file as its name's version ``version`` (default: the
    next). A new configuration is profiled and given the batching that fits ``p99_ms``; a
    kept one keeps its batching (unless the proof finds the file mixes rows). A file that
    changes the served signature is refused (InvalidInputError, nothing written) unless
    ``replace_signature``."""
    if plan.differences and not replace_signature:
        raise InvalidInputError(plan.refusal())
    notes: list[str] = []
    base = plan.draft
    if plan.kept is not None:
        base, policy = for_new_version(plan.kept)
        notes += [kept_note(base), *([policy] if policy else []), *_options_unused(plan)]
    if base.max_batch_size == 0 and plan.kept is None:
        notes.append("the graph has no dynamic batch dimension: one request per run")
    block = base.spillway
    files = {block.onnx_file: plan.source}
    if block.tokenizer_file and plan.tokenizer:
        files[block.tokenizer_file] = plan.tokenizer
    proof, table, proposal = _evidence(
        base, files, p99_ms if plan.kept is None else None, options or EngineOptions()
    )
    if proof is not None and not proof.safe:
        notes.append(f"not batch-safe, served without dynamic batching: {proof.detail}")
    config = configure(base, proof, proposal)
    if plan.served is not None and plan.differences:
        keep_outgoing(repository, plan.name, plan.served)
    published = repository.publish_version(plan.name, files, config, version=version)
    return Added(
        config,
        published,
        repository.location,
        proof,
        table,
        proposal,
        tuple(notes),
        kept=plan.kept is not None,
    )


def _evidence(
    config: ModelConfig, files: dict[str, Path], p99_ms: float | None, options: EngineOptions
) -> tuple[BatchProof | None, tuple[ProfileRow, ...], Proposal | None]:
    """The batch-safety proof of a batching ``config`` (``None`` for one that does not
    batch) and, when it is safe and a target ``p99_ms`` is given, the profile and the
    batching proposed for it; run as the servers load the version (which a model that
    does not batch is too)."""
    with tempfile.TemporaryDirectory(prefix="spillway-add-") as scratch:
        model = _load_scratch(Path(scratch), config, files, options)
        if config.max_batch_size == 0:
            return None, (), None
        proof = prove_batching(model)
        if not proof.safe or p99_ms is None:
            return proof, (), None
        table = profile(model)
    return proof, table, propose(table, p99_ms)


def _options_unused(plan: VersionPlan) -> list[str]:
    """A note where the options given make other processing than the kept one's."""
    draft, kept = plan.draft.spillway, plan.kept.spillway if plan.kept else None
    if kept is None or draft.kind != kept.kind or draft.kind == "tensor":
        return []
    if (draft.image, draft.max_sequence_length) == (kept.image, kept.max_sequence_length):
        return []
    return [
        f"the served {kept.kind} processing is kept; --replace-signature publishes the one "
        "these options make"
    ]


def kept_note(config: ModelConfig) -> str:
    """One line: the served configuration a new version keeps."""
    batching = config.dynamic_batching
    queued = (
        f", preferred_batch_size {list(batching.preferred_batch_size)}, "
        f"max_queue_delay_microseconds {batching.max_queue_delay_microseconds}"
        if batching is not None
        else ""
    )
    return (
        f"kept the served configuration of {config.name}: kind {config.spillway.kind}, "
        f"max_batch_size {config.max_batch_size}{queued}"
    )


def _load_scratch(
    root: Path, config: ModelConfig, files: dict[str, Path], options: EngineOptions
) -> OnnxModel:
    """The version published to a scratch repository and loaded as the servers load it."""
    (root / "repository").mkdir()
    scratch = LocalRepository(root / "repository")
    number = scratch.publish_version(config.name, files, config)
    return load_version(scratch, config, number, root / "cache", options)
