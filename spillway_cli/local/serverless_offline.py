"""The router under serverless-offline (``spillway up --router-runtime
serverless-offline``, ``auto`` where it can start): whether it can run here, and its
command line and environment for a stack. serverless.yml's ``local`` stage names the
handlers it runs (``spillway_cli.local.offline_handlers``).

The router's port is not serverless-offline's HTTP server: that one decodes a body as
UTF-8 text unless its type is ``application/octet-stream`` (its ``detectEncoding``;
serverless-offline issues 1107 and 1775), where API Gateway, told ``binaryMediaTypes:
["*/*"]``, hands the function every body base64-encoded. The REST API's door
(``spillway serve router --invoke``, ``door_command``) serves the port and hands each
event to the function through serverless-offline's Lambda invoke API (``--lambdaPort``);
serverless-offline's own HTTP server listens on a port nobody is told of."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from pathlib import Path

from spillway_cli.local import procs
from spillway_cli.local.layout import STATE_MACHINES, StackLayout
from spillway_cli.local.names import LOCAL_API_KEY, ROUTER_FUNCTION

log = logging.getLogger("spillway.stack")
ROOT = Path(__file__).resolve().parents[2]
SERVERLESS = ROOT / "node_modules" / ".bin" / "serverless"
APP_ZIP = ROOT / "build" / "lambda" / "app.zip"  # serverless.yml's package.artifact
# serverless-offline's first invocation starts a Python process that imports the router:
# seconds on an idle machine, more than a minute on a loaded 2-core one (as long as the
# other services are given), and `auto` must not pick the runtime by the machine's load.
FALLBACK_WAIT_S = 180.0
DOOR = "router-door"
"""The stack's name for the REST API's door in front of serverless-offline (its log:
``router-door.log``; ``router.log`` is serverless-offline's, the function's output)."""


def router_runtime(choice: str) -> str:
    """``auto``: serverless-offline when it can start — Node.js, the Serverless Framework
    (``make check-infra`` installs both) and the artefact serverless.yml runs
    (``build/lambda/app.zip``, built by ``make -f infra/lambda/Makefile serverless``) —
    else the WSGI router, saying what was missing."""
    runtime, why = runtime_choice(choice)
    log.info("router runtime: %s (%s)", runtime, why)
    return runtime


def runtime_choice(choice: str) -> tuple[str, str]:
    """The runtime ``choice`` (``wsgi``, ``serverless-offline``, ``auto``) gives, and why,
    in the words ``spillway up`` prints."""
    if choice != "auto":
        return choice, f"--router-runtime {choice}"
    missing = offline_missing()
    if missing:
        return "wsgi", f"auto: serverless-offline needs {', '.join(missing)}"
    zip_path = APP_ZIP.relative_to(ROOT)
    return "serverless-offline", f"auto: Node.js, the Serverless Framework and {zip_path} found"


RUNTIME_NAMES = {"wsgi": "WSGI", "serverless-offline": "serverless-offline"}
"""How ``spillway up`` names each runtime."""


def offline_missing() -> list[str]:
    """What serverless-offline would need to run the router and is not here."""
    needs = {
        "Node.js": shutil.which("node") is not None,
        "the Serverless Framework (node_modules)": SERVERLESS.exists(),
        f"{APP_ZIP.relative_to(ROOT)}": APP_ZIP.is_file(),
    }
    return [what for what, present in needs.items() if not present]


def door_command(stack: StackLayout, lambda_port: int) -> list[str]:
    """The REST API's door on the router's port: the API key checked, each request made
    API Gateway's event (``lambda_http.rest_app``) and handed to the router function
    through serverless-offline's Lambda invoke API on ``lambda_port``."""
    return [
        *(sys.executable, "-m", "spillway_cli.main", "serve", "router"),
        *("--host", "127.0.0.1", "--port", str(stack.ports.router)),
        *("--invoke", f"http://127.0.0.1:{lambda_port}", "--function", ROUTER_FUNCTION),
        *("--api-key", LOCAL_API_KEY),
    ]


def command(stack: StackLayout, lambda_port: int) -> tuple[list[str], dict[str, str]]:
    """serverless-offline's command line for ``stack``'s router (stage ``local``), its
    Lambda invoke API on ``lambda_port``, and the variables it adds to the stack's own;
    ``RuntimeError`` when its artefact is missing."""
    if not APP_ZIP.is_file():
        raise RuntimeError(
            f"serverless-offline runs {APP_ZIP}, which is missing: build it with "
            "`make -f infra/lambda/Makefile serverless`, or use --router-runtime wsgi"
        )
    argv = [
        str(SERVERLESS),
        "offline",
        "start",
        "--stage",
        "local",
        "--host",
        "127.0.0.1",
        # Its HTTP server, on a port nobody is told of: the door serves the router's.
        "--httpPort",
        str(procs.free_port()),
        "--lambdaPort",
        str(lambda_port),
        "--noPrependStageInUrl",
        f"--param=gpuUrl={stack.url('gpu')}",
        "--param=cpuFunction=spillway-cpu-infer",
        f"--param=awsEndpointUrl={stack.url('moto')}",
        f"--param=lambdaEndpointUrl={stack.url('cpu')}",
        # serverless.yml's local value is "{}": the local Step Functions endpoint's.
        f"--param=asyncStateMachines={json.dumps(STATE_MACHINES)}",
        # serverless-offline 13 cannot leave out serverless.yml's websocket events:
        # its WebSocket server goes to a free port nobody is told of, and the API is
        # served by `spillway serve websocket` (LocalStack._websocket).
        "--websocketPort",
        str(procs.free_port()),
        f"--param=wsManagementEndpoint={stack.url('websocket')}",
    ]
    venv = Path(sys.executable).parent.parent
    env = {
        "VIRTUAL_ENV": str(venv),
        "PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '')}",
        "AWS_ENDPOINT_URL_LAMBDA": stack.url("cpu"),
        # serverless-offline hands every AWS_* variable of its own to the handler.
        "AWS_ENDPOINT_URL_SFN": stack.url("states"),
        # serverless-offline puts this in requestContext.identity.apiKeyId (its default,
        # "offlineContext_apiKeyId", would make every caller one tenant of that name): the
        # local key stands for its own id, as on the WSGI runtime (lambda_http.api_key_door),
        # so `spillway tenants add spillway-local-key T` maps it on both.
        "SLS_API_KEY_ID": LOCAL_API_KEY,
        "SLS_TELEMETRY_DISABLED": "1",
        "SLS_NOTIFICATIONS_MODE": "off",
        "SLS_DEPRECATION_DISABLE": "*",
    }
    return argv, env
