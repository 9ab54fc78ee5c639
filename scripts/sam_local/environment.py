"""The environment ``sam local invoke`` gives each function, computed by the SAM CLI itself:
run with the SAM CLI's interpreter (.venv-sam), print JSON ``{"<logical id>": {NAME: value}}``.

    .venv-sam/bin/python scripts/sam_local/environment.py TEMPLATE ENV_VARS_FILE [FUNCTION...]

SAM's own resolution, not a copy of it: the template's variables with its parameters'
defaults (an ImportValue, a GetAtt or a Sub over either becomes "", a Ref to a resource its
logical id), the shell's values and then the env-vars file's for the names the template
declares, and the AWS_* variables of the local runtime. For an image function SAM names the
handler later, from the image's command; it is filled in here the same way.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from samcli.commands.local.lib.local_lambda import LocalLambdaRunner
from samcli.lib.providers.sam_function_provider import SamFunctionProvider
from samcli.lib.providers.sam_stack_provider import SamLocalStackProvider
from samcli.lib.utils.packagetype import IMAGE


def environments(template: str, env_vars: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """Each function's resolved environment, as the invoke command builds it."""
    stacks, _ = SamLocalStackProvider.get_stacks(template)
    provider = SamFunctionProvider(stacks)
    runner = LocalLambdaRunner(None, provider, ".", ".", env_vars_values=env_vars)
    result = {}
    for function in provider.get_all():
        if names and function.name not in names:
            continue
        variables = runner._make_env_vars(function).resolve()
        if function.packagetype == IMAGE:
            command = (function.imageconfig or {}).get("Command") or [None]
            variables["AWS_LAMBDA_FUNCTION_HANDLER"] = command[0]
        result[function.name] = variables
    return result


if __name__ == "__main__":
    template, env_file, *functions = sys.argv[1:]
    values = json.loads(Path(env_file).read_text(encoding="utf-8"))
    print(json.dumps(environments(template, values, functions), indent=1, sort_keys=True))
