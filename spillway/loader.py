"""Loading model versions, one way for every deployable.

The GPU service, the CPU fallback and the batch job all load through here: the model's
``version_policy`` picks the versions, the repository fetches and verifies every file
against its ``SHA256SUMS``, and each session is warmed before it takes a request.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from spillway.engine import EngineOptions, OnnxModel
from spillway.errors import ModelNotFoundError
from spillway.modelconfig import ModelConfig, VersionPolicy
from spillway.names import validate_model_name
from spillway.repository import ModelRepository

log = logging.getLogger("spillway.loader")


def chosen_versions(policy: VersionPolicy, available: list[int]) -> list[int]:
    """The versions a Triton version policy selects from those available (ascending)."""
    if policy.specific is not None:
        return [v for v in policy.specific["versions"] if v in available]
    if policy.all is not None:
        return list(available)
    count = policy.latest["num_versions"] if policy.latest else 1
    return available[-count:]


def served_versions(repository: ModelRepository, name: str) -> tuple[ModelConfig, list[int]]:
    """A model's configuration and the versions its policy serves; 404 if there are none."""
    config = repository.read_config(validate_model_name(name))
    versions = chosen_versions(config.version_policy, repository.list_versions(name))
    if not versions:
        raise ModelNotFoundError(
            f"model {name!r} has no version its version_policy serves in {repository.location}"
        )
    return config, versions


def warm_up(model: OnnxModel) -> None:
    """One row through every length bucket, then a full batch through the shortest: each
    shape class is initialised before the first request, at a bounded cost."""
    buckets = model.config.spillway.length_buckets
    lengths = [max(1, edge - 2) for edge in buckets] or [8]
    for length in lengths:
        model.infer(model.sample_inputs(1, length=length))
    if model.config.max_batch_size > 1:
        model.infer(model.sample_inputs(model.config.max_batch_size, length=lengths[0]))


def open_version(
    config: ModelConfig, version: int, path: Path, options: EngineOptions
) -> OnnxModel:
    """A session over a fetched, verified version folder, warmed up; blocking."""
    model = OnnxModel(config.name, version, config, path, options)
    warm_up(model)
    return model


def load_version(
    repository: ModelRepository,
    config: ModelConfig,
    version: int,
    cache_dir: Path,
    options: EngineOptions,
) -> OnnxModel:
    """Fetch (verifying checksums), open and warm one version; blocking."""
    started = time.monotonic()
    path = repository.fetch_version(config.name, version, cache_dir)
    model = open_version(config, version, path, options)
    log.info(
        "loaded %s v%d on %s in %.2f s",
        config.name,
        version,
        model.provider,
        time.monotonic() - started,
    )
    return model


def load_served(
    repository: ModelRepository,
    names: list[str] | None,
    cache_dir: Path,
    options: EngineOptions,
) -> dict[str, dict[int, OnnxModel]]:
    """Every version each model's policy serves (all models when ``names`` is ``None``);
    pipelines are not models to load (``spillway.ensemble`` serves them over these)."""
    loaded: dict[str, dict[int, OnnxModel]] = {}
    for name in repository.list_models() if names is None else names:
        config, versions = served_versions(repository, name)
        if config.is_pipeline:
            continue
        loaded[name] = {
            v: load_version(repository, config, v, cache_dir, options) for v in versions
        }
    return loaded
