"""Where the ``spillway models`` commands find a model repository and the GPU service,
and how they end when the repository or AWS says no.

The repository is ``--repository`` (a folder or ``s3://bucket/prefix``), else a deployed
stack's (``--stack NAME``: its ``StorageStack`` and ``ModelsPrefix`` parameters, that
stack's ``ModelsBucket`` output; boto3's own credentials and Region), else the running
local stack's (``SPILLWAY_REPOSITORY`` in its stack env file, found as every ``spillway``
command finds it: ``spillway_cli.local.stackenv``), else ``./models``. The GPU service is
``--gpu-url``, else the local stack's ``SPILLWAY_GPU_URL``.

Whatever fails (a name the repository does not have, no credentials, an endpoint that
does not answer, S3 refusing a call, a file that cannot be written) ends the command with
one line, ``error: …``, and exit status 1: never a traceback.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any, NoReturn

import typer

from spillway.protocol.errors import SpillwayError
from spillway_cli.local.stackenv import aws_errors, require_aws, use_stack_env

LOCAL_REPOSITORY = "models"
STORAGE_STACK = "spillway-storage"
"""template.yaml's ``StorageStack`` default: the stack holding the models bucket."""
MODELS_PREFIX = "models"
"""template.yaml's ``ModelsPrefix`` default."""
GPU_TIMEOUT_S = 300.0

RepositoryOption = Annotated[
    str | None,
    typer.Option(
        help="Folder or s3://bucket/prefix (default: the running stack's, else ./models)."
    ),
]
StackOption = Annotated[
    str | None,
    typer.Option(help="A deployed stack (CloudFormation): the model repository it serves from."),
]
GpuUrlOption = Annotated[
    str | None,
    typer.Option(
        "--gpu-url", help="The GPU service to load the change on (default: the local stack's)."
    ),
]


def fail(message: str) -> NoReturn:
    """Print ``error: message`` and end with exit status 1."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


@contextmanager
def failures() -> Iterator[None]:
    """One line and exit status 1 for whatever the repository or AWS answers with an
    error, instead of a traceback."""
    from spillway.aws.errors import BotoCoreError, ClientError

    try:
        with aws_errors():  # no region or credentials, an endpoint gone: the stack's fix
            yield
    except SpillwayError as exc:
        fail(exc.message)
    except ClientError as exc:
        error = exc.response.get("Error", {})
        fail(
            f"AWS refused {exc.operation_name}: {error.get('Code', '?')} "
            f"{error.get('Message', '')}".rstrip()
            + " (check the bucket or stack name and your credentials' permissions)"
        )
    except BotoCoreError as exc:
        fail(f"{exc} (check the endpoint, the bucket and your credentials)")
    except OSError as exc:
        fail(f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": "))


def repository_location(repository: str | None, stack: str | None = None) -> str:
    """The repository the flags, a deployed stack or the local stack name (see the
    module's docstring); exits with one line when it cannot be found."""
    if repository is not None and stack is not None:
        fail("give --repository or --stack, not both")
    if stack is not None:
        require_aws()
        from spillway.aws.clients import aws_client

        with failures():
            return deployed_repository(aws_client("cloudformation"), stack)
    use_stack_env()
    return repository or os.environ.get("SPILLWAY_REPOSITORY") or LOCAL_REPOSITORY


def deployed_repository(client: Any, stack: str) -> str:
    """``s3://<ModelsBucket>/<ModelsPrefix>`` of a deployed stack: its own
    ``ModelsBucket`` output (a storage stack named directly), else its ``StorageStack``
    parameter's."""
    found = client.describe_stacks(StackName=stack)["Stacks"][0]
    parameters = {p["ParameterKey"]: p.get("ParameterValue") for p in found.get("Parameters", [])}
    outputs = _outputs(found)
    storage = stack
    if "ModelsBucket" not in outputs:
        storage = parameters.get("StorageStack") or STORAGE_STACK
        outputs = _outputs(client.describe_stacks(StackName=storage)["Stacks"][0])
    if "ModelsBucket" not in outputs:
        fail(f"stack {storage} has no ModelsBucket output: name the app or storage stack")
    return f"s3://{outputs['ModelsBucket']}/{parameters.get('ModelsPrefix') or MODELS_PREFIX}"


def _outputs(stack: dict[str, Any]) -> dict[str, str]:
    return {o["OutputKey"]: str(o["OutputValue"]) for o in stack.get("Outputs", [])}


def gpu_url(flag: str | None, stack: str | None = None) -> str | None:
    """The GPU service a change is loaded on: ``--gpu-url``, else the local stack's
    (``None`` for a deployed stack, whose services poll their repository)."""
    return flag or (None if stack else os.environ.get("SPILLWAY_GPU_URL"))


def gpu_call(base_url: str, name: str, operation: str) -> tuple[bool, str]:
    """Ask the GPU service to ``load`` (read the model's versions and policy again: load
    what it serves, retire the rest) or ``unload`` ``name``; whether it did, and why not."""
    base = base_url.rstrip("/")
    token = os.environ.get("SPILLWAY_ADMIN_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(  # noqa: S310 - the operator's own service URL
        f"{base}/v2/repository/models/{name}/{operation}", b"", headers, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=GPU_TIMEOUT_S):  # noqa: S310
            return True, ""
    except urllib.error.HTTPError as error:
        return False, f"HTTP {error.code}: {error_message(error.read())}"
    except OSError as error:
        return False, f"it did not answer ({error})"


def serves(base_url: str, name: str) -> bool:
    """Whether the GPU service has ``name`` loaded (a version ready)."""
    url = f"{base_url.rstrip('/')}/v2/models/{name}/ready"
    try:
        with urllib.request.urlopen(url, timeout=30) as answer:  # noqa: S310
            return bool(answer.status == 200)
    except OSError:  # not loaded (4xx/5xx) or not there: nothing to reload
        return False


def error_message(body: bytes) -> str:
    """The ``error`` of a JSON error body, else the body's start."""
    try:
        return str(json.loads(body).get("error", body.decode(errors="replace")))
    except (ValueError, AttributeError):
        return body.decode(errors="replace")[:200]
