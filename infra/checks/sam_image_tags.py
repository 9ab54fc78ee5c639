"""The tags `sam build` and `sam deploy` give an image function, by SAM CLI's own code.

Runs in the SAM CLI's virtual environment, offline::

    .venv-sam/bin/python -m infra.checks.sam_image_tags template.yaml CpuInferFunction

SAM CLI reads the function from the template (its provider), names the local image as
``sam build`` does (``ApplicationBuilder._build_lambda_image``) and pushes it twice with
``ECRUploader.upload``, as two ``sam deploy`` runs of an unchanged image do. Docker and
ECR are replaced by recorders: the build returns no output, the image has a fixed ID,
and each push records the tag SAM asked for. Prints JSON: the local image name and the
remote reference of each push.
"""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Iterator
from typing import Any

from samcli.lib.build.app_builder import ApplicationBuilder
from samcli.lib.package.ecr_uploader import ECRUploader
from samcli.lib.providers.sam_function_provider import SamFunctionProvider
from samcli.lib.providers.sam_stack_provider import SamLocalStackProvider
from samcli.lib.utils.stream_writer import StreamWriter

REPOSITORY = "123456789012.dkr.ecr.us-east-1.amazonaws.com/spillway-storage-cpuimagerepository"
IMAGE_ID = "sha256:" + "5e1f0c2a9b8d" + "7" * 52


class _Build:
    """Docker's image build as SAM drives it: records the tag asked for, builds nothing."""

    def __init__(self) -> None:
        self.tags: list[str] = []

    def build_image(self, **kwargs: Any) -> Iterator[dict[str, str]]:
        self.tags.append(kwargs["tag"])
        return iter(())


class _Image:
    id = IMAGE_ID

    def tag(self, repository: str, tag: str) -> bool:
        return True


class _Docker:
    """The Docker client calls ``ECRUploader.upload`` makes (``images.get``,
    ``api.push``, ``login``), answered by one object."""

    def __init__(self, local: str) -> None:
        self.local = local
        self.images = self.api = self

    def get(self, name: str) -> _Image:
        if name not in (self.local, IMAGE_ID):
            raise LookupError(f"no local image {name}")
        return _Image()

    def push(self, **_: Any) -> Iterator[dict[str, str]]:
        return iter([{"status": "Pushed"}])

    def login(self, **_: Any) -> None:
        return None


class _Ecr:
    def get_authorization_token(self) -> dict[str, Any]:
        token = base64.b64encode(b"AWS:placeholder").decode()
        endpoint = f"https://{REPOSITORY.split('/')[0]}"
        return {"authorizationData": [{"authorizationToken": token, "proxyEndpoint": endpoint}]}


def image_tags(template: str, function_id: str) -> dict[str, Any]:
    """The local image name of ``function_id`` and the references two deploys push."""
    stacks, _ = SamLocalStackProvider.get_stacks(template)
    function = SamFunctionProvider(stacks).get(function_id)
    if function is None:
        raise LookupError(f"{template}: no function {function_id}")
    builder = ApplicationBuilder.__new__(ApplicationBuilder)
    builder._base_dir = "."
    builder._image_build_client = _Build()
    builder._stream_writer = StreamWriter(sys.stderr)
    local = builder._build_lambda_image(function.name, function.metadata, function.architectures[0])
    uploader = ECRUploader(_Docker(local), _Ecr(), REPOSITORY, None, no_progressbar=True)
    pushes = [uploader.upload(local, function.name) for _ in range(2)]
    return {"local": local, "repository": REPOSITORY, "pushes": pushes}


def main(argv: list[str]) -> int:
    """``sam_image_tags TEMPLATE FUNCTION``: print the tags as JSON."""
    if len(argv) != 2:
        print("usage: python -m infra.checks.sam_image_tags TEMPLATE FUNCTION", file=sys.stderr)
        return 2
    print(json.dumps(image_tags(argv[0], argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
