"""A model's versions as a user manages them (``spillway models``): which are served, what
a new version keeps, what a rollback serves and what a removal may take.

Versions are immutable. Every change here is a new ``config.json``, whose
``version_policy`` says which versions are served (read by ``loader.chosen_versions``, as
every server reads it), or a removal that leaves the version's tombstone
(``spillway.models.version_files``). Before ``config.json`` takes another signature, the
one it had is kept for the versions served under it (``keep_outgoing``), and a rollback to
one of them brings it back (``kept_config_of``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spillway.models.config import ModelConfig, VersionPolicy
from spillway.models.loader import chosen_versions
from spillway.models.repository import ManagedRepository, ModelRepository
from spillway.models.signature import signature_differences
from spillway.models.version_files import VersionRecord
from spillway.protocol.errors import InvalidInputError, ModelNotFoundError
from spillway.protocol.names import validate_model_name


@dataclass(frozen=True)
class ModelView:
    """A model as ``spillway models list`` and ``show`` print it."""

    name: str
    config: ModelConfig
    records: tuple[VersionRecord, ...]

    @property
    def versions(self) -> list[int]:
        """The committed versions, ascending."""
        return [r.version for r in self.records if r.removed is None]

    @property
    def served(self) -> list[int]:
        """The versions the policy serves (what every server loads)."""
        return chosen_versions(self.config.version_policy, self.versions)

    @property
    def default(self) -> int | None:
        """The version a request that names none gets."""
        return self.config.default_version(self.served)


def view_model(repository: ManagedRepository, name: str) -> ModelView:
    """``name``'s configuration and versions; ModelNotFoundError when there is no such
    model."""
    config = repository.read_config(validate_model_name(name))
    return ModelView(name, config, tuple(repository.version_records(name)))


def served_now(repository: ModelRepository, name: str) -> tuple[ModelConfig, list[int]] | None:
    """``name``'s configuration and the versions it serves; ``None`` for a new name."""
    try:
        config = repository.read_config(validate_model_name(name))
    except ModelNotFoundError:
        return None
    return config, chosen_versions(config.version_policy, repository.list_versions(name))


def for_new_version(served: ModelConfig) -> tuple[ModelConfig, str | None]:
    """The configuration a new version that keeps ``served``'s signature is published
    under: ``served`` itself, except that a policy naming versions (a rollback's) gives
    way to the newest version, which a new version is published to be; and why."""
    specific = served.version_policy.specific
    if specific is None:
        return served, None
    named = list(specific["versions"])
    if served.spillway.canary is not None:
        return served, f"version_policy still serves {named} (a canary is configured)"
    latest = VersionPolicy(latest={"num_versions": 1})
    newest = served.model_copy(update={"version_policy": latest})
    return newest, f"version_policy specific {named} -> latest 1: the new version is served"


def keep_outgoing(repository: ManagedRepository, name: str, outgoing: ModelConfig) -> None:
    """Before ``config.json`` trades ``outgoing`` for another signature: keep it as the
    configuration of the newest version (and of the older ones no earlier record covers),
    unless one is kept for that version already."""
    versions = repository.list_versions(name)
    if versions and versions[-1] not in repository.kept_configs(name):
        repository.keep_config(name, versions[-1], outgoing)


def kept_config_of(repository: ManagedRepository, name: str, version: int) -> ModelConfig | None:
    """The configuration ``version`` was served under, where a later signature replaced
    it: the one kept for the first version at or after it; ``None`` where none was."""
    kept = repository.kept_configs(name)
    covering = [number for number in kept if number >= version]
    return kept[min(covering)] if covering else None


@dataclass(frozen=True)
class Rollback:
    """What ``rollback`` changed: the model before and after, and what the written
    configuration restored or dropped."""

    before: ModelView
    after: ModelView
    restored: tuple[str, ...] = ()
    """Signature differences undone: the configuration the version was served under is
    back."""
    dropped_canary: bool = False


def rollback(repository: ManagedRepository, name: str, to: int | None = None) -> Rollback:
    """Serve the version before the one requests get now (or ``to``), alone: a new
    ``config.json`` whose ``version_policy`` names it. Where that version was served under
    another configuration (a signature replaced since), that one comes back with it. A
    canary in ``config.json`` ends (it names versions no longer served)."""
    before = view_model(repository, name)
    target = _target(before, to)
    own = kept_config_of(repository, name, target)
    restored = tuple(signature_differences(before.config, own)) if own is not None else ()
    if restored:
        keep_outgoing(repository, name, before.config)
    fields: dict[str, Any] = (own or before.config).model_dump()
    fields["version_policy"] = {"specific": {"versions": [target]}}
    dropped = fields["spillway"].get("canary") is not None
    fields["spillway"]["canary"] = None
    config = ModelConfig.model_validate(fields)
    repository.write_config(name, config)
    return Rollback(before, ModelView(name, config, before.records), restored, dropped)


def _target(model: ModelView, to: int | None) -> int:
    current = model.default
    if to is not None:
        if to not in model.versions:
            raise ModelNotFoundError(f"model {model.name!r} has no version {to}")
        if model.served == [to]:
            raise InvalidInputError(f"{model.name} already serves v{to} alone")
        return to
    if current is None:
        raise InvalidInputError(f"{model.name} serves no version: name one with --to")
    older = [v for v in model.versions if v < current]
    if not older:
        raise InvalidInputError(
            f"{model.name} serves v{current}, its oldest version: there is nothing to roll back to"
        )
    return older[-1]


def remove_version(repository: ManagedRepository, name: str, version: int) -> ModelView:
    """Remove ``version`` unless requests would be left with no version: it may not be
    the only one served, nor one of a canary ``config.json`` configures. The model after."""
    model = view_model(repository, name)
    if version not in model.versions:
        gone = any(r.version == version and r.removed for r in model.records)
        raise ModelNotFoundError(
            f"model {name!r} has no version {version}{' (it was removed)' if gone else ''}"
        )
    if model.served == [version]:
        others = [v for v in model.versions if v != version]
        instead = f"remove the whole model (`spillway models remove {name} --yes`)"
        if others:
            serve = f"spillway models rollback {name} --to {others[-1]}"
            instead = f"serve another first (`{serve}`), or {instead}"
        raise InvalidInputError(f"v{version} is the only version {name} serves: {instead}")
    canary = model.config.spillway.canary
    if canary is not None and version in (canary.version, canary.stable):
        raise InvalidInputError(
            f"v{version} is in the canary config.json configures for {name} "
            f"(v{canary.version} over v{canary.stable}): roll back or publish without it first"
        )
    repository.remove_version(name, version)
    return view_model(repository, name)


def remove_model(repository: ManagedRepository, name: str) -> ModelView:
    """Remove the model whole (its number sequence starts again); what it was."""
    model = view_model(repository, name)
    repository.remove_model(name)
    return model
