"""Translate template.yaml into plain CloudFormation, offline, for checkov.

Some checkov checks only see plain resources (``AWS::Lambda::Function``,
``AWS::ApiGateway::Stage``), so the SAM template is also checked after translation.
Runs in the SAM CLI's virtual environment (it brings ``aws-sam-translator``)::

    .venv-sam/bin/python -m infra.checks.translate_sam template.yaml OUT.json

Local artefact paths (``CodeUri: .``, the nested application's ``Location``, the image
function's missing ``ImageUri``) are replaced by placeholders (a state machine's local
``DefinitionUri`` by the definition itself), as ``sam package`` would
replace them by S3 and ECR addresses. The checkov skips written on a SAM resource (its
``Metadata``) are copied to every resource generated from it (same logical-ID prefix), so
a skip and its reason are written once, in template.yaml.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

from samcli.yamlhelper import yaml_parse
from samtranslator.parser.parser import Parser
from samtranslator.translator.translator import Translator

PLACEHOLDER_IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/spillway-cpu:placeholder"
PLACEHOLDER_CODE = "s3://spillway-placeholder/code.zip"
PLACEHOLDER_TEMPLATE = "https://s3.amazonaws.com/spillway-placeholder/observability.yaml"


def packaged(template: dict[str, Any]) -> dict[str, Any]:
    """The template as ``sam package`` would leave it: artefacts at remote addresses."""
    result = copy.deepcopy(template)
    for resource in result.get("Resources", {}).values():
        kind, props = resource.get("Type"), resource.setdefault("Properties", {})
        if kind == "AWS::Serverless::Function":
            if props.get("PackageType") == "Image":
                props.setdefault("ImageUri", PLACEHOLDER_IMAGE)
            else:
                props["CodeUri"] = PLACEHOLDER_CODE
        elif kind == "AWS::Serverless::LayerVersion":
            props["ContentUri"] = PLACEHOLDER_CODE
        elif kind == "AWS::Serverless::Application":
            props["Location"] = PLACEHOLDER_TEMPLATE
        elif kind == "AWS::Serverless::StateMachine" and "DefinitionUri" in props:
            # Inlined rather than uploaded, so checkov sees the definition.
            props["Definition"] = json.loads(Path(props.pop("DefinitionUri")).read_text())
    return result


def translate(template: dict[str, Any]) -> dict[str, Any]:
    """Plain CloudFormation for a SAM template (parameters at their defaults)."""
    translator = Translator(managed_policy_map={}, sam_parser=Parser())
    output: dict[str, Any] = translator.translate(
        sam_template=packaged(template),
        parameter_values={},
        passthrough_metadata=True,
        get_managed_policy_map=lambda: {},
    )
    return output


def carry_skips(source: dict[str, Any], output: dict[str, Any]) -> None:
    """Copy each SAM resource's checkov skips to the resources generated from it."""
    for name, resource in source.get("Resources", {}).items():
        if not str(resource.get("Type", "")).startswith("AWS::Serverless::"):
            continue
        skips = resource.get("Metadata", {}).get("checkov", {}).get("skip", [])
        if not skips:
            continue
        for generated_name, generated in output.get("Resources", {}).items():
            if generated_name == name or not generated_name.startswith(name):
                continue
            checkov = generated.setdefault("Metadata", {}).setdefault("checkov", {})
            known = {skip["id"] for skip in checkov.setdefault("skip", [])}
            checkov["skip"] += [skip for skip in skips if skip["id"] not in known]


def main(argv: list[str]) -> int:
    """``translate_sam TEMPLATE OUT``: write the translated template as JSON."""
    if len(argv) != 2:
        print("usage: python -m infra.checks.translate_sam TEMPLATE OUT", file=sys.stderr)
        return 2
    # The translator needs a region for pseudo parameters; nothing is called.
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    source = yaml_parse(Path(argv[0]).read_text(encoding="utf-8"))
    output = translate(source)
    carry_skips(source, output)
    Path(argv[1]).parent.mkdir(parents=True, exist_ok=True)
    Path(argv[1]).write_text(json.dumps(output, indent=1, sort_keys=True), encoding="utf-8")
    print(f"{argv[0]}: {len(output.get('Resources', {}))} CloudFormation resources -> {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
