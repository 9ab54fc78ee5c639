"""A second `sam deploy` of an unchanged CPU image succeeds; every other tag stays immutable.

GIVEN the tags SAM CLI's own code gives the CPU-fallback image (``sam build`` names it
``<function>:<DockerTag>``, ``sam deploy`` pushes ``<function>-<image id[:12]>-<DockerTag>``:
``infra.checks.sam_image_tags`` runs that code with Docker and ECR replaced by recorders)
AND the CPU image repository as the storage stack creates it
WHEN the unchanged image is deployed a second time
THEN ECR accepts the push of the same tag, while any other tag pushed twice is refused.

ECR's rules, as modelled here (Amazon ECR user guide, image tag mutability): in an
``IMMUTABLE`` repository a push to an existing tag is refused even when it is the same
image (``tag invalid: The image tag … already exists … and cannot be overwritten because
the repository is immutable``); ``IMMUTABLE_WITH_EXCLUSION`` makes the tags that match
one of its wildcard filters mutable; ``MUTABLE_WITH_EXCLUSION`` the reverse.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping
from typing import Any

import pytest

from infra.checks.iam_eval import glob_matches
from tests.unit.stacks import ROOT, deploy

SAM_PYTHON = ROOT / ".venv-sam/bin/python"
DIGEST = "sha256:" + "a" * 64
OTHER_DIGEST = "sha256:" + "b" * 64


def ecr_accepts(repository: Mapping[str, Any], existing: Mapping[str, str], tag: str) -> bool:
    """Whether ECR accepts a push of ``tag`` to a repository holding ``existing`` tags."""
    if tag not in existing:
        return True
    mode = repository.get("ImageTagMutability", "MUTABLE")
    filters = [
        f["ImageTagMutabilityExclusionFilterValue"]
        for f in repository.get("ImageTagMutabilityExclusionFilters", [])
        if f["ImageTagMutabilityExclusionFilterType"] == "WILDCARD"
    ]
    excluded = any(glob_matches(pattern, tag) for pattern in filters)
    mutable = {
        "MUTABLE": True,
        "IMMUTABLE": False,
        "IMMUTABLE_WITH_EXCLUSION": excluded,
        "MUTABLE_WITH_EXCLUSION": not excluded,
    }
    return mutable[mode]


def _repository(logical: str) -> dict[str, Any]:
    return deploy().storage.properties(logical)


@pytest.fixture(scope="module")
def sam_tags() -> dict[str, Any]:
    """What SAM CLI names and pushes for CpuInferFunction (two deploys, one image)."""
    if not SAM_PYTHON.exists():
        pytest.skip("make check-infra installs the SAM CLI into .venv-sam")
    env = {**os.environ, "AWS_DEFAULT_REGION": "us-east-1", "SAM_CLI_TELEMETRY": "0"}
    result = subprocess.run(
        [str(SAM_PYTHON), "-m", "infra.checks.sam_image_tags", "template.yaml", "CpuInferFunction"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    tags: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return tags


def test_sam_pushes_an_unchanged_image_under_the_same_tag(sam_tags: dict[str, Any]) -> None:
    first, second = sam_tags["pushes"]
    assert first == second
    assert first.startswith(sam_tags["repository"] + ":")


def test_the_second_deploy_of_an_unchanged_image_is_accepted(sam_tags: dict[str, Any]) -> None:
    repository = _repository("CpuImageRepository")
    tag = sam_tags["pushes"][0].rsplit(":", 1)[1]
    # WHEN the first deploy pushes the image THEN ECR takes it
    assert ecr_accepts(repository, {}, tag)
    # WHEN the next deploy pushes the same image under the same tag THEN ECR takes it too
    assert ecr_accepts(repository, {tag: DIGEST}, tag)


@pytest.mark.parametrize("logical", ["CpuImageRepository", "GpuImageRepository"])
@pytest.mark.parametrize("tag", ["3f2a9c1d0b7e", "latest", "v1.2.3", "cpuinferfunction"])
def test_every_other_tag_stays_immutable(logical: str, tag: str) -> None:
    # GIVEN a tag pushed by hand (docs/deploy.md: one tag per build) or guessed
    repository = _repository(logical)
    # THEN it can never be pointed at another image
    assert not ecr_accepts(repository, {tag: DIGEST}, tag)
    assert repository["ImageTagMutability"] in ("IMMUTABLE", "IMMUTABLE_WITH_EXCLUSION")


def test_the_model_of_ecr_refuses_a_same_image_push_to_an_immutable_tag() -> None:
    # The rule the failure came from: immutability does not look at the digest.
    assert not ecr_accepts({"ImageTagMutability": "IMMUTABLE"}, {"t": DIGEST}, "t")
    assert ecr_accepts({"ImageTagMutability": "MUTABLE"}, {"t": OTHER_DIGEST}, "t")
