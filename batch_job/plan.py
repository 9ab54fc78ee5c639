"""Shard planning: one shard per input file, frozen in ``_plan.json`` at the output prefix.

The unit of work is an input object (``.jsonl``/``.ndjson`` records, a ``.npy`` array, or
a ``.v2req`` infer request the router staged for batch mode): it is what a producer writes
atomically, S3 lists it with its size and ETag, and a shard can then be re-run from
scratch without reading any other file. Large inputs should be written as several files.
Images (``.png``, ``.jpg``, ``.jpeg``) are one record each: up to ``IMAGES_PER_SHARD`` of
them, in key order, make one shard of format ``images`` that lists each with its ETag.
The first submission (or run) freezes the plan, so every array child, retry and later
re-run sees the same shards even if the input prefix changes.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from batch_job.storage import ObjectStore, open_location
from spillway.aws.limits import S3_KEY_BYTES
from spillway.models.repository import ModelRepository
from spillway.protocol.errors import InvalidInputError, JobConflictError, ModelNotFoundError
from spillway.protocol.messages import STAGED_SUFFIX
from spillway.protocol.names import validate_model_name
from spillway.protocol.s3urls import is_s3_url

InputFormat = Literal["jsonl", "npy", "staged", "images"]
SUFFIXES: dict[str, InputFormat] = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".npy": "npy",
    STAGED_SUFFIX: "staged",
    ".png": "images",
    ".jpg": "images",
    ".jpeg": "images",
}
IMAGES_PER_SHARD = 32
"""Image objects per ``images`` shard: enough that a shard's commit (a few S3 calls) is
small beside its pages' inference, few enough that a retry redoes little."""
PLAN_NAME = "_plan.json"


class InputObject(BaseModel):
    """An input object as listed: its key, size and ETag."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str
    size: int = Field(ge=0)
    etag: str = ""


class ShardSpec(BaseModel):
    """One shard: an input object (an ``images`` shard: its first image) and how to read
    it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    index: int = Field(ge=0)
    key: str
    format: InputFormat
    size: int = Field(ge=0)
    etag: str = ""
    images: tuple[InputObject, ...] = ()
    """An ``images`` shard's image objects, each one record (``size``: theirs together)."""

    @property
    def name(self) -> str:
        """``part-00007``: the stem of every object this shard writes."""
        return f"part-{self.index:05d}"


class Plan(BaseModel):
    """A job's shards, its input and the exact model version every child uses."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    input: str
    model: str
    model_version: int = Field(ge=1)
    shards: tuple[ShardSpec, ...] = Field(min_length=1)
    created_at: str

    def assigned(self, index: int | None, size: int | None) -> list[ShardSpec]:
        """The shards array child ``index`` of ``size`` runs: ``index``, ``index+size``…;
        every shard when ``index`` is ``None``."""
        if index is None:
            return list(self.shards)
        stride = size or len(self.shards)
        if index >= stride:
            raise InvalidInputError(f"array index {index} is outside the array of {stride}")
        return list(self.shards[index::stride])


@dataclass(frozen=True)
class OutputLayout:
    """Where a job writes under its output prefix."""

    prefix: str

    @property
    def plan(self) -> str:
        return f"{self.prefix}{PLAN_NAME}"

    @property
    def committed_prefix(self) -> str:
        return f"{self.prefix}_committed/"

    def key(self, name: str) -> str:
        """The final key of a file a shard wrote (``part-00007.jsonl`` …)."""
        return f"{self.prefix}{name}"

    def manifest(self, shard: ShardSpec) -> str:
        return f"{self.prefix}{shard.name}.manifest.json"

    def marker(self, shard: ShardSpec) -> str:
        """The completion marker: its existence is the shard's commit point."""
        return f"{self.committed_prefix}{shard.name}.json"

    def temp(self, final_key: str) -> str:
        """The temporary key a final object is staged at before the commit."""
        return f"{self.prefix}_tmp/{final_key.removeprefix(self.prefix)}"


def check_output_keys(output: str) -> None:
    """Every key a job writes under ``output`` (an ``s3://`` folder) fits S3's 1,024 bytes
    (``spillway.aws.limits.S3_KEY_BYTES``) and its URL the 1,024 characters a location may have;
    else a 400 when the job is submitted, not a failed write once its shards have run.
    The longest key is a shard's staged manifest, ``_tmp/part-<index>.manifest.json``
    (an index of ten digits allowed for)."""
    if not is_s3_url(output):
        return
    key = output.removeprefix("s3://").partition("/")[2].strip("/")
    layout = OutputLayout(f"{key}/" if key else "")
    shard = ShardSpec(index=10**10 - 1, key="", format="jsonl", size=0)
    longest = layout.temp(layout.manifest(shard))
    size = len(longest.encode())
    if size > S3_KEY_BYTES or len(output) > S3_KEY_BYTES:
        raise InvalidInputError(
            f"the output location is too long: the job's keys under it would be up to {size} "
            f"bytes ({len(output)} characters as a URL); S3 and this service allow "
            f"{S3_KEY_BYTES}"
        )


def plan_shards(store: ObjectStore, prefix: str, input_url: str, model: str, version: int) -> Plan:
    """One shard per non-empty input file under ``prefix``, in key order, then one per
    ``IMAGES_PER_SHARD`` images."""
    shards: list[ShardSpec] = []
    images: list[InputObject] = []
    for obj in store.list_objects(prefix):
        base = obj.key.rsplit("/", 1)[-1]
        kind = _format(base[base.rfind(".") :] if "." in base else "")
        if obj.size == 0 or base.startswith(("_", ".")) or kind is None:
            continue
        if kind == "images":
            images.append(InputObject(key=obj.key, size=obj.size, etag=obj.etag))
            continue
        shards.append(
            ShardSpec(
                index=len(shards),
                key=obj.key,
                format=kind,
                size=obj.size,
                etag=obj.etag,
            )
        )
    for start in range(0, len(images), IMAGES_PER_SHARD):
        group = tuple(images[start : start + IMAGES_PER_SHARD])
        shards.append(
            ShardSpec(
                index=len(shards),
                key=group[0].key,
                format="images",
                size=sum(image.size for image in group),
                images=group,
            )
        )
    if not shards:
        known = ", ".join(SUFFIXES)
        raise InvalidInputError(f"no input ({known}) under {input_url[:200]}")
    created = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    return Plan(
        input=input_url,
        model=model,
        model_version=version,
        shards=tuple(shards),
        created_at=created,
    )


def _format(suffix: str) -> InputFormat | None:
    found = SUFFIXES.get(suffix)
    if found is None and SUFFIXES.get(suffix.lower()) == "images":
        return "images"  # cameras write .JPG
    return found


def load_plan(store: ObjectStore, layout: OutputLayout) -> Plan | None:
    """The frozen plan at the output prefix, if any."""
    raw = store.get_bytes(layout.plan)
    return None if raw is None else Plan.model_validate_json(raw)


def check_plan(plan: Plan, input_url: str, model: str, version: int | None) -> None:
    """Refuse to mix two different jobs in one output prefix."""
    if (plan.input.rstrip("/"), plan.model) != (input_url.rstrip("/"), model) or (
        version is not None and version != plan.model_version
    ):
        raise JobConflictError(
            f"the output prefix already holds a job of {plan.model} v{plan.model_version} "
            f"over {plan.input}; use another output prefix"
        )


def check_disjoint(input_url: str, output_url: str) -> None:
    """Outputs inside the input prefix would be read back as input by a later plan."""
    a, b = input_url.rstrip("/") + "/", output_url.rstrip("/") + "/"
    if a.startswith(b) or b.startswith(a):
        raise InvalidInputError("input and output prefixes must not contain each other")


@dataclass(frozen=True)
class RunSpec:
    """What ``spillway jobs run`` was asked to do."""

    model: str
    input: str
    output: str
    version: int | None = None
    batch_size: int | None = None


@dataclass(frozen=True)
class Locations:
    """The input and output stores of a job and their key prefixes."""

    input: ObjectStore
    input_prefix: str
    output: ObjectStore
    layout: OutputLayout

    @classmethod
    def of(cls, spec: RunSpec, *, client: Any | None = None) -> Locations:
        """Open both locations of ``spec`` (S3 through ``client`` when given)."""
        check_disjoint(spec.input, spec.output)
        in_store, in_prefix = open_location(spec.input, client=client)
        out_store, out_prefix = open_location(spec.output, client=client)
        return cls(in_store, in_prefix, out_store, OutputLayout(out_prefix))


def ensure_plan(spec: RunSpec, repository: ModelRepository, where: Locations) -> Plan:
    """The frozen plan at the output prefix, created from the input listing if absent."""
    validate_model_name(spec.model)
    plan = load_plan(where.output, where.layout)
    if plan is not None:
        check_plan(plan, spec.input, spec.model, spec.version)
        return plan
    version = resolve_version(repository, spec.model, spec.version)
    plan = plan_shards(where.input, where.input_prefix, spec.input, spec.model, version)
    where.output.put_bytes(where.layout.plan, plan.model_dump_json(indent=2).encode())
    return plan


def resolve_version(repository: ModelRepository, model: str, version: int | None) -> int:
    """``version`` if the repository has it; when none was asked for, the newest (the
    stable one while the model's configuration names a canary)."""
    versions = repository.list_versions(model)
    if not versions:
        raise ModelNotFoundError(f"model {model!r} is not in the repository")
    if version is None:
        return repository.read_config(model).default_version(versions) or versions[-1]
    if version not in versions:
        raise ModelNotFoundError(f"model {model!r} has no version {version}")
    return version
