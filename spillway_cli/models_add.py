"""``spillway models add``: serve your own ONNX model.

The configuration comes from the graph, the batching from a proof and a profile
(``spillway.models.onboarding``); this module parses the options, prints the evidence and,
with ``--load``, asks the running GPU service to load the model. Defaults come from the
running stack's env file (``spillway_cli.models_where``): its repository and GPU service.

A new version of an existing name keeps the name's served configuration (kind, processing,
batching) when the file keeps its signature; a file with another signature is refused in
one line listing the differences, exit status 2, nothing written, unless
``--replace-signature`` (then the differences are printed first).
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from spillway_cli.models_where import (
    error_message,
    fail,
    failures,
    gpu_url,
    repository_location,
)

if TYPE_CHECKING:
    from spillway.models.new_version import Added, VersionPlan
    from spillway.models.onboarding import ProfileRow
    from spillway.models.signature import ImageOptions

LOAD_TIMEOUT_S = 300.0
EXIT_SIGNATURE = 2
"""``models add``'s exit status when a file would change a served signature."""


def models_add(
    file: Annotated[Path, typer.Argument(help="The ONNX file.", exists=True, dir_okay=False)],
    name: Annotated[str, typer.Option(help="Model name.")],
    repository: Annotated[
        str | None,
        typer.Option(
            help="Folder or s3://bucket/prefix (default: the running stack's, else ./models)."
        ),
    ] = None,
    version: Annotated[int | None, typer.Option(help="Version number (default: the next).")] = None,
    p99_ms: Annotated[float, typer.Option(help="p99 latency target for batching.")] = 50.0,
    tokenizer: Annotated[
        Path | None,
        typer.Option(help="tokenizer.json: serve a text embedding model.", exists=True),
    ] = None,
    max_sequence_length: Annotated[
        int | None, typer.Option(help="Token limit of a text model (default: the tokenizer's).")
    ] = None,
    image: Annotated[
        bool,
        typer.Option(help="Serve an image model: its rank-4 float input takes JPEG/PNG bytes."),
    ] = False,
    image_size: Annotated[
        tuple[int, int] | None,
        typer.Option(help="Height and width images are resized to (default: the graph's)."),
    ] = None,
    mean: Annotated[
        str | None, typer.Option(help="Per-channel mean, e.g. 0.485,0.456,0.406 (default 0).")
    ] = None,
    std: Annotated[
        str | None, typer.Option(help="Per-channel std, e.g. 0.229,0.224,0.225 (default 1).")
    ] = None,
    scale: Annotated[
        float | None, typer.Option(help="Pixel scale before mean and std (default 1/255).")
    ] = None,
    color: Annotated[
        str | None, typer.Option(help="RGB, BGR or GRAY (default: GRAY for 1 channel, else RGB).")
    ] = None,
    resize: Annotated[
        str | None, typer.Option(help="stretch (default) or letterbox to the size.")
    ] = None,
    replace_signature: Annotated[
        bool,
        typer.Option(
            "--replace-signature",
            help="Publish a file whose signature differs from the name's served one "
            "(the differences are printed first).",
        ),
    ] = False,
    load: Annotated[bool, typer.Option(help="Ask the running GPU service to load it.")] = False,
    gpu_url_option: Annotated[
        str | None,
        typer.Option("--gpu-url", help="GPU service URL for --load (default: the stack's)."),
    ] = None,
) -> None:
    """Add an ONNX model: config from its graph, proven batch-safe, profiled, published;
    a new version of a name keeps its served signature and configuration."""
    from spillway.models.new_version import add_model, plan_version
    from spillway.models.repository import open_repository

    images = image_options(image, image_size, mean, std, scale, color, resize)
    location = repository_location(repository)
    url = gpu_url(gpu_url_option)
    if load and not url:  # before anything is written
        fail(f"--load needs the GPU service: pass --gpu-url; {_no_stack()}")
    with failures():
        if not location.startswith("s3://"):
            Path(location).mkdir(parents=True, exist_ok=True)
        repo = open_repository(location)
        plan = plan_version(
            repo,
            name,
            file,
            tokenizer=tokenizer,
            max_sequence_length=max_sequence_length,
            image=images,
        )
        if plan.differences and not replace_signature:
            typer.echo(f"error: {plan.refusal()}", err=True)
            raise typer.Exit(EXIT_SIGNATURE)
        for line in replacing(plan):
            typer.echo(line)
        added = add_model(
            repo, plan, version=version, p99_ms=p99_ms, replace_signature=replace_signature
        )
    for line in report(added, p99_ms):
        typer.echo(line)
    if load and url:
        ready, line = load_model(url, name, os.environ.get("SPILLWAY_ADMIN_TOKEN"))
        typer.echo(line)
        if not ready:
            raise typer.Exit(1)


def _no_stack() -> str:
    from spillway_cli.local.stackenv import find_stack_env

    return (
        f"no running stack was found through {find_stack_env()} (start one with `spillway "
        "up`: a single running stack is found from any folder; with several, run this where "
        "yours runs or set SPILLWAY_STACK_ENV to its env.json); nothing was written"
    )


def replacing(plan: VersionPlan) -> list[str]:
    """What ``--replace-signature`` changes, printed before it is published."""
    if not plan.differences:
        return []
    served = ", ".join(f"v{v}" for v in plan.served_versions) or "no version"
    head = f"{plan.name}: replacing the signature served ({served}) with {plan.source.name}'s:"
    return [head, *(f"  {difference}" for difference in plan.differences)]


def image_options(
    image: bool,
    size: tuple[int, int] | None,
    mean: str | None,
    std: str | None,
    scale: float | None,
    color: str | None,
    resize: str | None,
) -> ImageOptions | None:
    """The image options given, ``None`` without ``--image``; exits with one line where an
    image option comes without ``--image`` or a list is not numbers."""
    from spillway.models.signature import ImageOptions

    given = {"--image-size": size, "--mean": mean, "--std": std, "--scale": scale}
    given |= {"--color": color, "--resize": resize}
    if not image:
        stray = [option for option, value in given.items() if value is not None]
        if stray:
            typer.echo(f"error: {', '.join(stray)} only with --image", err=True)
            raise typer.Exit(1)
        return None
    return ImageOptions(
        size=size,
        color=color.upper() if color else None,
        resize=resize.lower() if resize else None,
        mean=_floats("--mean", mean),
        std=_floats("--std", std),
        scale=scale,
    )


def _floats(option: str, text: str | None) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        typer.echo(f"error: {option} takes numbers separated by commas, not {text!r}", err=True)
        raise typer.Exit(1) from None


def report(added: Added, p99_ms: float) -> list[str]:
    """What ``models add`` prints: the proof, the table it chose from and the choice."""
    config = added.config
    lines = [f"{config.name} v{added.version} written to {added.location}"]
    if added.proof is not None and added.proof.safe:
        lines.append(f"batch-safe: {added.proof.detail}")
    lines += list(added.notes)
    if added.profile:
        lines += [f"profile (p99 target {p99_ms:g} ms):", *profile_table(added.profile)]
    if added.proposal is not None:
        proposal = added.proposal
        lines.append(
            f"chosen: max_batch_size {proposal.max_batch_size}, preferred_batch_size "
            f"{list(proposal.preferred_batch_size)}, max_queue_delay_microseconds "
            f"{proposal.max_queue_delay_microseconds}: {proposal.reason}"
        )
    lines.append(f"max_batch_size: {config.max_batch_size}")
    return lines


def profile_table(rows: tuple[ProfileRow, ...]) -> list[str]:
    """The profile as aligned columns: batch, p50 ms, p99 ms, rows/s."""
    head = f"{'batch':>6} {'p50 ms':>9} {'p99 ms':>9} {'rows/s':>10}"
    return [head] + [
        f"{r.batch:>6} {r.p50_ms:>9.2f} {r.p99_ms:>9.2f} {r.rows_per_s:>10.0f}" for r in rows
    ]


def load_model(base_url: str, name: str, admin_token: str | None) -> tuple[bool, str]:
    """Ask the GPU service to load ``name`` (its repository API): whether the model is
    ready, and one line saying so or why the load failed."""
    base = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
    load = urllib.request.Request(  # noqa: S310 - the operator's own service URL
        f"{base}/v2/repository/models/{name}/load", data=b"", method="POST", headers=headers
    )
    try:
        with urllib.request.urlopen(load, timeout=LOAD_TIMEOUT_S):  # noqa: S310
            pass
        ready = urllib.request.Request(f"{base}/v2/models/{name}/ready")  # noqa: S310
        with urllib.request.urlopen(ready, timeout=30) as answer:  # noqa: S310
            return answer.status == 200, f"{name}: ready on {base}"
    except urllib.error.HTTPError as error:
        return (
            False,
            f"{name}: not ready on {base} (HTTP {error.code}: {error_message(error.read())})",
        )
    except OSError as error:
        return False, f"{name}: the GPU service at {base} did not answer ({error})"
