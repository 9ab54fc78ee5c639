"""The templates the second-deploy check reads, as plain CloudFormation.

Every template a deployment uses, under the name it is shown and locked by: template.yaml
as the SAM translator turns it into CloudFormation (in the SAM CLI's environment), the
infra/ stacks as written, and the template ``serverless package`` wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from infra.checks.cfn_eval import load_cfn

ROOT = Path(__file__).resolve().parents[3]
SAM_TEMPLATE = "template.yaml"
SLS_TEMPLATE = "serverless.yml (packaged)"
# Every template a deployment uses: the name it is shown (and locked) under, its path.
TEMPLATES = {
    SAM_TEMPLATE: "template.yaml",
    "infra/network.yaml": "infra/network.yaml",
    "infra/storage.yaml": "infra/storage.yaml",
    "infra/ecs-gpu-service.yaml": "infra/ecs-gpu-service.yaml",
    "infra/batch.yaml": "infra/batch.yaml",
    "infra/observability.yaml": "infra/observability.yaml",
    SLS_TEMPLATE: ".serverless/cloudformation-template-update-stack.json",
}


def load_templates(root: Path, translated: Path | None = None) -> dict[str, dict[str, Any]]:
    """Every template of ``TEMPLATES`` under ``root``; template.yaml as translated."""
    templates: dict[str, dict[str, Any]] = {}
    for name, relative in TEMPLATES.items():
        path = root / relative
        if not path.exists():
            hint = " (scripts/check_infra.sh packages it)" if name == SLS_TEMPLATE else ""
            raise SystemExit(f"second_deploy: {path} is missing{hint}")
        if name == SAM_TEMPLATE:
            templates[name] = _translated(path, translated)
        elif path.suffix == ".json":
            templates[name] = json.loads(path.read_text(encoding="utf-8"))
        else:
            templates[name] = load_cfn(path)
    return templates


def _translated(template: Path, translated: Path | None) -> dict[str, Any]:
    """template.yaml as plain CloudFormation (the SAM translator, in the SAM environment)."""
    if translated is not None:
        data: dict[str, Any] = json.loads(translated.read_text(encoding="utf-8"))
        return data
    python = Path(os.environ.get("SAM_VENV", ROOT / ".venv-sam")) / "bin" / "python"
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "template.json"
        # Run from the repository: the state machines' DefinitionUri paths are relative.
        result = subprocess.run(  # noqa: S603 - our own module, in our own environment
            [str(python), "-m", "infra.checks.translate_sam", str(template.resolve()), str(out)],
            cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
            env={**os.environ, "AWS_DEFAULT_REGION": "us-east-1", "SAM_CLI_TELEMETRY": "0"},
        )  # fmt: skip
        if result.returncode != 0:
            raise SystemExit(f"second_deploy: translating {template} failed:\n{result.stderr}")
        data = json.loads(out.read_text(encoding="utf-8"))
    return data


def resources(template: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The template's resources by logical ID."""
    found: dict[str, dict[str, Any]] = template.get("Resources", {})
    return found
