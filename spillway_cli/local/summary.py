"""What a running local stack tells its user: each part's URL, pid and log (the trace
view's page and receiver), the router's runtime and why, and the first lines to try
(``LocalStack.summary``)."""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path

from spillway_cli.local.layout import STATE_MACHINES, StackLayout
from spillway_cli.local.names import LOCAL_API_KEY
from spillway_cli.local.procs import Child
from spillway_cli.local.serverless_offline import DOOR, RUNTIME_NAMES


def summary(stack: StackLayout, children: Mapping[str, Child], states_served: bool) -> str:
    """URLs (each started child's, with its pid and log) and a first request to try."""
    lines = []
    for name, c in children.items():
        if name == DOOR:  # under serverless-offline: the router's port is the door's
            lines.append(
                f"  {'':<9} (REST API door in front: pid {c.pid}, log {c.log_path}; the "
                "function runs under serverless-offline)"
            )
        elif name == "traces":
            lines.append(
                f"  {'traces':<9} {stack.traces_url}  (trace view; OTLP/HTTP receiver "
                f"{stack.url('traces')}/v1/traces; pid {c.pid}, log {c.log_path})"
            )
        elif name != "websocket":
            lines.append(f"  {name:<9} {stack.url(name)}  (pid {c.pid}, log {c.log_path})")
    if "websocket" in children:
        child = children["websocket"]
        lines.append(
            f"  {'websocket':<9} {stack.websocket_url}  (pid {child.pid}, log {child.log_path})"
        )
    if "gpu" in children:  # the GPU service's second door
        lines.append(f"  {'gpu-grpc':<9} 127.0.0.1:{stack.ports.gpu_grpc}  (KServe V2 gRPC)")
    if states_served:
        lines.append(
            f"  {'states':<9} {stack.url('states')}  (Step Functions: StartExecution, "
            f"DescribeExecution; in this process; async {', '.join(STATE_MACHINES)})"
        )
    body = json.dumps(
        {
            "inputs": [
                {
                    "name": "text",
                    "shape": [1, 1],
                    "datatype": "BYTES",
                    "data": ["hello from spillway"],
                }
            ]
        }
    )
    curl_headers = "".join(f" -H '{k}: {v}'" for k, v in stack.router_headers.items())
    lines += [
        "",
        "Try:",
        f"  curl -s {stack.url('router')}/v2/models/minilm/infer{curl_headers} "
        f"-H 'content-type: application/json' -d '{body}' -D - | head -20",
        f"  {tritonclient_line(stack)}",
        f"  sam local invoke <Function> -e events/... --env-vars {stack.sam_env_path} "
        '(README.md, "sam local invoke")',
    ]
    return "\n".join(lines)


def runtime_line(stack: StackLayout) -> str:
    """Which runtime runs the router, why, and whether it checks API keys."""
    name = RUNTIME_NAMES.get(stack.router_runtime, stack.router_runtime)
    why = f" ({stack.router_reason})" if stack.router_reason else ""
    if stack.router_runtime == "serverless-offline" or stack.check_api_keys:
        keys = (
            f"a request without the local API key (x-api-key: {LOCAL_API_KEY}) is refused "
            "with 403, as API Gateway refuses it"
        )
    else:
        keys = "no API key is checked (every caller is the anonymous tenant)"
    return f"Router runtime: {name}{why}; {keys}."


def tritonclient_line(stack: StackLayout) -> str:
    """A shell line that infers one image on ``digits`` through the router with
    tritonclient, in this virtual environment's Python, and prints its label."""
    headers = f", headers={stack.router_headers!r}" if stack.router_headers else ""
    code = (
        "import numpy as np, tritonclient.http as t; "
        f"c = t.InferenceServerClient('127.0.0.1:{stack.ports.router}'); "
        "x = t.InferInput('image', [1, 8, 8], 'FP32'); "
        "x.set_data_from_numpy(np.full((1, 8, 8), 8, np.float32)); "
        f"print(c.infer('digits', [x]{headers}).as_numpy('label'))"
    )
    return f'{_python()} -c "{code}"'


def _python() -> str:
    """This Python as a shell word: relative to the working folder when inside it
    (``.venv/bin/python``), absolute otherwise."""
    executable = Path(sys.executable)
    try:
        shown = executable.relative_to(Path.cwd()).as_posix()
    except ValueError:
        return shlex.quote(str(executable))
    return shlex.quote(shown if "/" in shown else f"./{shown}")
