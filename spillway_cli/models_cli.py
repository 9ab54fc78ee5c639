"""``spillway models list | show | remove | rollback | promote | publish``: the model
registry a user drives, on a folder or an S3 repository, the local stack's or a deployed
stack's (``spillway_cli.models_where`` finds it).

Versions are immutable (``spillway.models.lineage``): ``rollback`` writes a new
``config.json`` whose ``version_policy`` serves the previous version; ``remove --version``
leaves a tombstone, so that the number never names another version. After a change, a GPU
service that serves the model (the local stack's, or ``--gpu-url``) is asked to read it
again; a deployed stack's services read it on their next poll of the repository.
``promote`` is ``models canary --promote`` under its own name.

Registered by ``spillway_cli.main`` on the ``models`` group.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from spillway_cli.canary_cli import CpuFunctionOption, CpuUrlOption, TableOption, models_canary
from spillway_cli.canary_cli import GpuUrlOption as RouterGpuUrlOption
from spillway_cli.models_where import (
    GpuUrlOption,
    RepositoryOption,
    StackOption,
    fail,
    failures,
    gpu_call,
    gpu_url,
    repository_location,
    serves,
)

if TYPE_CHECKING:
    from spillway.models.config import ModelConfig, TensorConfig, VersionPolicy
    from spillway.models.lineage import ModelView
    from spillway.models.version_files import VersionRecord

JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON.")]
NameArgument = Annotated[str, typer.Argument(help="Model name.")]


def models_list(
    repository: RepositoryOption = None, stack: StackOption = None, as_json: JsonOption = False
) -> None:
    """Every model: kind, versions, the served ones, inputs and outputs."""
    from spillway.models.lineage import view_model
    from spillway.models.repository import open_repository
    from spillway.protocol.errors import SpillwayError

    location = repository_location(repository, stack)
    found: list[ModelView | tuple[str, str]] = []
    with failures():
        repo = open_repository(location)
        for name in repo.list_models():
            try:
                found.append(view_model(repo, name))
            except SpillwayError as exc:  # one broken model does not hide the others
                found.append((name, exc.message))
    if as_json:
        document = [
            _summary(v) if not isinstance(v, tuple) else {"name": v[0], "error": v[1]}
            for v in found
        ]
        typer.echo(json.dumps(document, indent=2))
        return
    if not found:
        typer.echo(f"no models in {repo.location}")
        return
    rows = [("MODEL", "KIND", "VERSIONS", "SERVED", "INPUTS -> OUTPUTS")]
    rows += [_row(entry) for entry in found]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        cells = "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False))
        typer.echo(f"{cells}  {row[4]}")


def _row(entry: ModelView | tuple[str, str]) -> tuple[str, str, str, str, str]:
    """A model's line of ``list``, or its name and why it could not be read."""
    if isinstance(entry, tuple):
        return (entry[0], "?", "", "", f"error: {entry[1]}")
    config = entry.config
    return (entry.name, _kind(config), _numbers(entry.versions), _served(entry), _signature(config))


def models_show(
    name: NameArgument,
    repository: RepositoryOption = None,
    stack: StackOption = None,
    as_json: JsonOption = False,
) -> None:
    """A model's configuration, signature, and versions with their checksums and times."""
    from spillway.models.lineage import view_model
    from spillway.models.repository import open_repository

    location = repository_location(repository, stack)
    with failures():
        repo = open_repository(location)
        view = view_model(repo, name)
    if as_json:
        document = {
            **_summary(view),
            "location": repo.location,
            "config": view.config.to_json_dict(),
            "records": [_record(r) for r in view.records],
        }
        typer.echo(json.dumps(document, indent=2))
        return
    for line in show_lines(view, repo.location):
        typer.echo(line)


def models_remove(
    name: NameArgument,
    version: Annotated[int | None, typer.Option(help="Remove only this version.")] = None,
    yes: Annotated[bool, typer.Option("--yes", help="Remove the whole model.")] = False,
    repository: RepositoryOption = None,
    stack: StackOption = None,
    gpu: GpuUrlOption = None,
) -> None:
    """Remove one version (--version N; not the only one served), or the whole model
    (--yes). A removed version's number is never given to another version."""
    from spillway.models.lineage import remove_model, remove_version
    from spillway.models.repository import open_repository

    if version is None and not yes:
        fail(f"removing {name} removes every version: add --yes (or --version N for one)")
    location = repository_location(repository, stack)
    with failures():
        repo = open_repository(location)
        if version is None:
            gone = remove_model(repo, name).versions
            done = f"removed {name} from {repo.location}: {_numbers(gone, 'v')} (a model added "
            done += "again under this name starts at v1)"
        else:
            after = remove_version(repo, name, version)
            done = f"removed {name} v{version} from {repo.location}; served: {_served(after, 'v')}"
    typer.echo(done)
    _tell_gpu(name, gpu_url(gpu, stack), stack, "unload" if version is None else "load")


def models_rollback(
    name: NameArgument,
    to: Annotated[
        int | None, typer.Option(help="The version to serve (default: the previous one).")
    ] = None,
    repository: RepositoryOption = None,
    stack: StackOption = None,
    gpu: GpuUrlOption = None,
) -> None:
    """Serve the previous version (or --to N) alone: a new config.json whose
    version_policy names it; no version's files change."""
    from spillway.models.lineage import rollback
    from spillway.models.repository import open_repository

    location = repository_location(repository, stack)
    with failures():
        repo = open_repository(location)
        change = rollback(repo, name, to)
    before, after = change.before, change.after
    typer.echo(
        f"{name}: served {_served(before, 'v')} -> {_served(after, 'v')} (version_policy "
        f"{_policy(before.config.version_policy)} -> {_policy(after.config.version_policy)}) "
        f"in {repo.location}"
    )
    target = after.served[0]
    if change.restored:
        typer.echo(
            f"  v{target} is served under its own configuration again: "
            + "; ".join(change.restored)
        )
    if change.dropped_canary:
        typer.echo("  the canary config.json configured ends (its versions are not all served)")
    newer = [v for v in before.versions if v > target]
    if newer:
        stay = "stays" if len(newer) == 1 else "stay"
        typer.echo(
            f"  {_numbers(newer, 'v')} {stay} in the repository: `spillway models rollback "
            f"{name} --to {newer[-1]}` serves v{newer[-1]} again"
        )
    _tell_gpu(name, gpu_url(gpu, stack), stack, "load")


def models_promote(
    name: NameArgument,
    table: TableOption = None,
    version: Annotated[int | None, typer.Option(help="The canary version expected.")] = None,
    allow_pinned: Annotated[
        bool | None,
        typer.Option("--allow-pinned/--refuse-pinned", help="As `models canary`."),
    ] = None,
    gpu_url: RouterGpuUrlOption = None,
    cpu_url: CpuUrlOption = None,
    cpu_function: CpuFunctionOption = None,
) -> None:
    """Make the running canary the stable version (`spillway models canary --promote`):
    refused while a backend the routers send to does not serve it."""
    models_canary(
        model=name,
        table=table,
        version=version,
        promote=True,
        allow_pinned=allow_pinned,
        gpu_url=gpu_url,
        cpu_url=cpu_url,
        cpu_function=cpu_function,
    )


def models_publish(
    model: Annotated[str, typer.Option(help="Model name.")],
    file: Annotated[
        Path, typer.Option(help="The ONNX file of the new version.", exists=True, dir_okay=False)
    ],
    repository: RepositoryOption = None,
    stack: StackOption = None,
    config: Annotated[
        Path | None, typer.Option(help="config.json (required for a new model).", exists=True)
    ] = None,
    extra: Annotated[
        list[Path] | None,
        typer.Option(help="More files for the version (tokenizer.json).", exists=True),
    ] = None,
) -> None:
    """Add the next version of a model, with its checksums; a serving GPU service swaps it
    in on its next poll or load request."""
    from spillway.models.lineage import keep_outgoing, served_now
    from spillway.models.repository import open_repository
    from spillway.models.signature import signature_differences

    location = repository_location(repository, stack)
    parsed = _config_file(config) if config else None
    with failures():
        repo = open_repository(location)
        served = served_now(repo, model)
        in_force = parsed if parsed is not None else served[0] if served else None
        if in_force is None:
            fail(f"{model} is a new model: give its --config")
        if parsed is not None and served and signature_differences(served[0], parsed):
            keep_outgoing(repo, model, served[0])  # a rollback serves the old versions as they were
        files = {in_force.spillway.onnx_file: file, **{p.name: p for p in extra or []}}
        version = repo.publish_version(model, files, parsed)
    typer.echo(f"published {model} v{version} to {repo.location}")


def _config_file(path: Path) -> ModelConfig:
    from pydantic import ValidationError

    from spillway.models.config import ModelConfig

    try:
        return ModelConfig.model_validate_json(path.read_bytes())
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        fail(f"{path} is not a model configuration: {where + ': ' if where else ''}{error['msg']}")


def _tell_gpu(name: str, url: str | None, stack: str | None, operation: str) -> None:
    """Have the GPU service read the change: load (serve what the policy names now,
    retire the rest) where it serves the model, or unload it."""
    if url is None:
        if stack is not None:
            typer.echo(f"{stack}'s services read it on their next poll of the repository")
        return
    if not serves(url, name):
        return
    done, why = gpu_call(url, name, operation)
    if not done:
        fail(f"the GPU service at {url} did not {operation} {name}: {why}")
    typer.echo(f"gpu: {url} {'loaded the change' if operation == 'load' else 'unloaded it'}")


# -- what the commands print -------------------------------------------------------------


def show_lines(view: ModelView, location: str) -> list[str]:
    """``spillway models show`` as lines."""
    config = view.config
    lines = [f"{view.name} in {location}", f"  {_serving(config)}"]
    default = f"v{view.default}" if view.default is not None else "none"
    lines.append(
        f"  version_policy {_policy(config.version_policy)}: serves {_served(view, 'v')}; "
        f"a request naming no version gets {default}"
    )
    block = config.spillway
    if block.description:
        lines.append(f"  description: {block.description}")
    if block.image is not None:
        image = block.image.model_dump(exclude_defaults=True, exclude={"input"})
        lines.append(f"  image {block.image.input!r}: {_pairs(image)}")
    if block.tokenizer_file:
        lines.append(
            f"  tokenizer {block.tokenizer_file}, max_sequence_length {block.max_sequence_length}"
        )
    if block.canary is not None:
        canary = block.canary
        lines.append(f"  canary: v{canary.version} over v{canary.stable} at {canary.percent:g}%")
    lines.append(f"  inputs:  {_tensors(config, config.input)}")
    lines.append(f"  outputs: {_tensors(config, config.output)}")
    lines.append("  versions:")
    for record in view.records:
        lines += _record_lines(record, view)
    return lines


def _record_lines(record: VersionRecord, view: ModelView) -> list[str]:
    if record.removed is not None:
        return [f"    v{record.version}  removed {_when(record.removed)}"]
    marks = [m for m, on in (("served", record.version in view.served),) if on]
    if record.version == view.default:
        marks.append("default")
    head = f"    v{record.version}  {_when(record.created)}  {', '.join(marks)}".rstrip()
    sums = [f"        {digest}  {file}" for file, digest in sorted(record.checksums.items())]
    return [head, *(sums or ["        (no SHA256SUMS: served as found)"])]


def _serving(config: ModelConfig) -> str:
    text = f"kind {_kind(config)}, max_batch_size {config.max_batch_size}"
    batching = config.dynamic_batching
    if batching is None:
        return f"{text}, no dynamic batching"
    return (
        f"{text}, dynamic batching (preferred_batch_size "
        f"{list(batching.preferred_batch_size)}, max_queue_delay_microseconds "
        f"{batching.max_queue_delay_microseconds})"
    )


def _summary(view: ModelView) -> dict[str, Any]:
    from spillway.models.signature import served_shape

    config = view.config

    def tensors(group: tuple[TensorConfig, ...]) -> list[dict[str, Any]]:
        return [
            {"name": t.name, "datatype": t.datatype, "shape": list(served_shape(config, t))}
            for t in group
        ]

    return {
        "name": view.name,
        "kind": _kind(config),
        "versions": view.versions,
        "served": view.served,
        "default": view.default,
        "inputs": tensors(config.input),
        "outputs": tensors(config.output),
    }


def _record(record: VersionRecord) -> dict[str, Any]:
    return {
        "version": record.version,
        "created": _when(record.created) if record.created is not None else None,
        "removed": _when(record.removed) if record.removed is not None else None,
        "checksums": dict(record.checksums),
    }


def _kind(config: ModelConfig) -> str:
    return "pipeline" if config.is_pipeline else config.spillway.kind


def _signature(config: ModelConfig) -> str:
    return f"{_tensors(config, config.input)} -> {_tensors(config, config.output)}"


def _tensors(config: ModelConfig, tensors: tuple[TensorConfig, ...]) -> str:
    from spillway.models.signature import describe_tensor

    return ", ".join(describe_tensor(config, t) for t in tensors)


def _served(view: ModelView, prefix: str = "") -> str:
    served = _numbers(view.served, prefix) or "none"
    if len(view.served) > 1 and view.default is not None:
        return f"{served} (default {prefix}{view.default})"
    return served


def _numbers(versions: list[int], prefix: str = "") -> str:
    return " ".join(f"{prefix}{v}" for v in versions)


def _policy(policy: VersionPolicy) -> str:
    if policy.specific is not None:
        return f"specific {list(policy.specific['versions'])}"
    if policy.all is not None:
        return "all"
    return f"latest {(policy.latest or {}).get('num_versions', 1)}"


def _pairs(values: dict[str, Any]) -> str:
    return ", ".join(f"{k} {list(v) if isinstance(v, tuple) else v}" for k, v in values.items())


def _when(seconds: float | None) -> str:
    if seconds is None:
        return "(time unknown)"
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M:%SZ")
