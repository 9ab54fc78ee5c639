"""template.yaml and serverless.yml describe the same functions; the templates stay lean.

GIVEN the SAM template and the Serverless Framework configuration (its variables resolved
from ``params.default`` for stage ``prod``, as ``serverless package --stage prod`` does)
THEN they declare the same functions, handlers, runtimes, architecture, memory, timeouts,
environment variable names, concurrency and events; every handler imports; the Lambda
dependency layer pins what requirements.txt pins; IAM grants no wildcard actions; the
Dockerfiles run as non-root from pinned bases without secrets.

``scripts/check_infra.sh`` also sets ``SPILLWAY_SLS_PACKAGED`` to the CloudFormation that
``serverless package`` wrote, and the packaged functions are held to the same parity.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.checks.cfn_eval import load_cfn
from spillway.policy.rules import parse_policy
from spillway.powertools import API_GATEWAY_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]
STAGE = "prod"
# SAM logical id -> Serverless function key
FUNCTIONS = {"RouterFunction": "router", "CpuInferFunction": "cpuInfer", "JobsFunction": "jobs",
             "WebSocketFunction": "websocket"}  # fmt: skip
SLS_LOGICAL = {"router": "RouterLambdaFunction", "cpuInfer": "CpuInferLambdaFunction",
               "jobs": "JobsLambdaFunction", "websocket": "WebsocketLambdaFunction"}  # fmt: skip
IAM_TEMPLATES = [
    "template.yaml",
    "infra/network.yaml",
    "infra/storage.yaml",
    "infra/ecs-gpu-service.yaml",
    "infra/batch.yaml",
    "infra/observability.yaml",
    "infra/serverless-resources.yml",
]
# Actions that have no resource-level permissions, so IAM only accepts Resource "*".
STAR_RESOURCE_ACTIONS = {
    "ec2:DescribeNetworkInterfaces",
    "ec2:DescribeSubnets",
    "xray:PutTraceSegments",
    "xray:PutTelemetryRecords",
    "ecr:GetAuthorizationToken",
    "batch:DescribeJobs",
    "lambda:ListEventSourceMappings",
}


_VAR = re.compile(r"\$\{([^{}]+)\}")
_BARE = re.compile(r"[A-Za-z][A-Za-z0-9]*")


class SlsResolver:
    """The few Serverless variable sources serverless.yml uses, as the framework resolves
    them for ``--stage prod`` (params of the stage over ``params.default``)."""

    def __init__(
        self, config: dict[str, Any], stage: str = STAGE, cli: dict[str, Any] | None = None
    ) -> None:
        self.config = config
        self.stage = stage
        params = config.get("params", {})
        self.params = {**params.get("default", {}), **params.get(stage, {}), **(cli or {})}

    def _source(self, expression: str) -> Any:
        # CloudFormation's own (in a Fn::Sub), or a bare name (a state machine's
        # DefinitionSubstitutions placeholder): the framework leaves both as they are.
        if expression.startswith("AWS::") or _BARE.fullmatch(expression):
            return f"${{{expression}}}"
        expression, _, fallback = expression.partition(",")
        kind, _, name = expression.strip().partition(":")
        if kind == "param":
            return self.resolve(self.params[name])
        if kind == "self":
            value: Any = self.config
            for part in name.split("."):
                value = value[part]
            return self.resolve(value)
        if kind == "sls" and name == "stage":
            return self.stage
        if kind == "opt":
            return fallback.strip().strip("'\"") if name != "stage" else self.stage
        if kind.startswith("file("):
            inner = expression.strip()[len("file(") : -1]
            return self.resolve(yaml.safe_load((ROOT / inner).read_text(encoding="utf-8")))
        raise AssertionError(f"unknown variable source in ${{{expression}}}")

    def resolve(self, value: Any) -> Any:
        """The value with every variable replaced (a whole-string variable keeps its type)."""
        if isinstance(value, dict):
            return {key: self.resolve(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.resolve(item) for item in value]
        if isinstance(value, str):
            whole = _VAR.fullmatch(value)
            if whole:
                return self._source(whole.group(1))
            return _VAR.sub(lambda m: str(self._source(m.group(1))), value)
        return value


@pytest.fixture(scope="module")
def sam() -> dict[str, Any]:
    return load_cfn(ROOT / "template.yaml")


@pytest.fixture(scope="module")
def sls() -> dict[str, Any]:
    raw = yaml.safe_load((ROOT / "serverless.yml").read_text(encoding="utf-8"))
    # --param="cpuImageUri=..." is given on the command line (a pushed image's digest).
    cli = {"cpuImageUri": "123456789012.dkr.ecr.us-east-1.amazonaws.com/cpu@sha256:" + "0" * 64}
    resolved: dict[str, Any] = SlsResolver(raw, cli=cli).resolve(
        {key: value for key, value in raw.items() if key not in ("params", "resources")}
    )
    return resolved


def sam_value(template: dict[str, Any], value: Any) -> Any:
    """A property's value at the parameters' defaults (``Ref`` to a parameter resolved)."""
    if isinstance(value, dict) and set(value) == {"Ref"}:
        parameter = template["Parameters"].get(value["Ref"])
        if parameter is not None:
            return parameter["Default"]
    if isinstance(value, dict) and "Fn::If" in value:
        condition, yes, no = value["Fn::If"]
        if condition.endswith("ProvisionedConcurrency"):
            count = sam_value(template, yes["ProvisionedConcurrentExecutions"])
            return yes if int(count) else no
        if condition.endswith("ReservedConcurrency"):  # 0: no reservation (AWS::NoValue)
            return int(sam_value(template, yes)) or None
    return value


def reserved(value: Any) -> int | None:
    """A reserved concurrency, or ``None`` for an unreserved function."""
    return None if value is None else int(value)


def sam_function(template: dict[str, Any], name: str) -> dict[str, Any]:
    props: dict[str, Any] = template["Resources"][name]["Properties"]
    return props


def sam_env_names(template: dict[str, Any], name: str) -> set[str]:
    globals_env = template["Globals"]["Function"]["Environment"]["Variables"]
    own = sam_function(template, name)["Environment"]["Variables"]
    return set(globals_env) | set(own)


def sls_env_names(config: dict[str, Any], key: str) -> set[str]:
    return set(config["provider"]["environment"]) | set(config["functions"][key]["environment"])


def sam_provisioned(template: dict[str, Any], name: str) -> int:
    config = sam_value(template, sam_function(template, name).get("ProvisionedConcurrencyConfig"))
    if not isinstance(config, dict) or "ProvisionedConcurrentExecutions" not in config:
        return 0
    return int(sam_value(template, config["ProvisionedConcurrentExecutions"]))


def test_both_declare_the_same_functions(sam: dict[str, Any], sls: dict[str, Any]) -> None:
    sam_functions = {
        name
        for name, resource in sam["Resources"].items()
        if resource["Type"] == "AWS::Serverless::Function"
    }
    assert sam_functions == set(FUNCTIONS)
    assert set(sls["functions"]) == set(FUNCTIONS.values())


@pytest.mark.parametrize(("sam_name", "sls_key"), FUNCTIONS.items())
def test_function_parity(
    sam: dict[str, Any], sls: dict[str, Any], sam_name: str, sls_key: str
) -> None:
    props, fn = sam_function(sam, sam_name), sls["functions"][sls_key]
    if props.get("PackageType") == "Image":
        assert props["ImageConfig"]["Command"] == fn["image"]["command"]
    else:
        assert props["Handler"] == fn["handler"]
        assert props["Runtime"] == fn.get("runtime", sls["provider"]["runtime"]) == "python3.12"
    assert sam["Globals"]["Function"]["Architectures"] == [sls["provider"]["architecture"]]
    assert sls["provider"]["architecture"] == "x86_64"
    memory = sam_value(sam, props["MemorySize"])
    assert int(memory) == int(fn.get("memorySize", sls["provider"]["memorySize"]))
    assert int(props["Timeout"]) == int(fn["timeout"])
    assert sam_env_names(sam, sam_name) == sls_env_names(sls, sls_key)
    sam_reserved = sam_value(sam, props.get("ReservedConcurrentExecutions"))
    assert reserved(sam_reserved) == reserved(fn.get("reservedConcurrency"))
    assert sam_provisioned(sam, sam_name) == int(fn.get("provisionedConcurrency", 0))
    assert props["FunctionName"]["Fn::Sub"].endswith(fn["name"].split(f"-{STAGE}", 1)[1])


@pytest.mark.parametrize("sam_name", ["RouterFunction", "WebSocketFunction"])
def test_the_functions_behind_api_gateway_time_out_with_it(
    sam: dict[str, Any], sls: dict[str, Any], sam_name: str
) -> None:
    # the timeout spillway_cli.local.offline_handlers puts in place of serverless-offline's 6 s
    fn = sls["functions"][FUNCTIONS[sam_name]]
    timeout = int(sam_function(sam, sam_name)["Timeout"])
    assert timeout == int(fn["timeout"]) == API_GATEWAY_TIMEOUT_S


def dockerfile_bases(text: str) -> list[str]:
    """The images of the FROM lines, a ``${ARG}`` replaced by the argument's default (what
    a build without ``--build-arg`` uses)."""
    defaults = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, re.MULTILINE))
    bases = re.findall(r"^FROM\s+(\S+)", text, re.MULTILINE)
    return [re.sub(r"\$\{(\w+)\}", lambda m: defaults.get(m[1], m[0]), b) for b in bases]


def test_image_function_runs_python312_x86_64(sam: dict[str, Any]) -> None:
    metadata = sam["Resources"]["CpuInferFunction"]["Metadata"]
    dockerfile = (ROOT / metadata["Dockerfile"]).read_text(encoding="utf-8")
    base = dockerfile_bases(dockerfile)[0]
    assert base.startswith("public.ecr.aws/lambda/python:3.12")
    assert "x86_64" in base
    command = sam_function(sam, "CpuInferFunction")["ImageConfig"]["Command"]
    assert f'CMD ["{command[0]}"]' in dockerfile


def _sam_events(template: dict[str, Any], name: str) -> tuple[set[tuple[str, str]], list[str]]:
    http, schedules = set(), []
    for event in sam_function(template, name).get("Events", {}).values():
        props = event["Properties"]
        if event["Type"] == "Api":
            http.add((props["Path"], props["Method"].upper()))
        elif event["Type"] == "Schedule":
            schedules.append(sam_value(template, props["Schedule"]))
    return http, schedules


def _sls_events(config: dict[str, Any], key: str) -> tuple[set[tuple[str, str]], list[str]]:
    http, schedules = set(), []
    for event in config["functions"][key].get("events", []):
        if "http" in event:
            http.add((event["http"]["path"], event["http"]["method"].upper()))
            assert event["http"]["authorizer"] == "aws_iam"
            assert event["http"]["private"] is True
        elif "eventBridge" in event:
            schedules.append(event["eventBridge"]["schedule"])
            assert "deadLetterQueueArn" in event["eventBridge"]
    return http, schedules


@pytest.mark.parametrize(("sam_name", "sls_key"), FUNCTIONS.items())
def test_event_parity(
    sam: dict[str, Any], sls: dict[str, Any], sam_name: str, sls_key: str
) -> None:
    assert _sam_events(sam, sam_name) == _sls_events(sls, sls_key)


def test_routes_and_schedule(sam: dict[str, Any]) -> None:
    router_http, _ = _sam_events(sam, "RouterFunction")
    jobs_http, jobs_schedules = _sam_events(sam, "JobsFunction")
    assert ("/v2/{proxy+}", "ANY") in router_http
    assert {("/v1/jobs", "POST"), ("/v1/jobs/{id}", "GET")} == jobs_http
    assert jobs_schedules == ["cron(0 1 * * ? *)"]


def test_every_route_needs_the_apis_auth(sam: dict[str, Any]) -> None:
    # GIVEN the REST API: IAM (SigV4) by default and an API key on every method
    auth = sam["Resources"]["Api"]["Properties"]["Auth"]
    assert (auth["DefaultAuthorizer"], auth["ApiKeyRequired"]) == ("AWS_IAM", True)
    # THEN no route of any function, the jobs API's included, opts out of either
    for name in FUNCTIONS:
        for event in sam_function(sam, name).get("Events", {}).values():
            if event["Type"] == "Api":
                override = event["Properties"].get("Auth", {})
                assert override.get("Authorizer", "AWS_IAM") == "AWS_IAM", (name, event)
                assert override.get("ApiKeyRequired", True) is True, (name, event)
                assert event["Properties"]["RestApiId"] == {"Ref": "Api"}


def test_the_jobs_api_knows_callers_and_areas_as_the_router_does(
    sam: dict[str, Any], sls: dict[str, Any]
) -> None:
    # GIVEN the environments of the router and the jobs function in both forms
    sam_jobs = sam_function(sam, "JobsFunction")["Environment"]["Variables"]
    sam_router = sam_function(sam, "RouterFunction")["Environment"]["Variables"]
    # THEN both read one identity map, and the jobs function's staging area is the
    # router's staging prefix
    assert sam_jobs["JOBS_CONFIG_TABLE"] == sam_router["ROUTER_STATE_TABLE"]
    assert sam_jobs["JOBS_STAGING"] == sam_router["ROUTER_JOBS_STAGING"]
    assert sam_jobs["JOBS_TENANTS_ROOT"]["Fn::Sub"][0] == "s3://${Bucket}/tenants"
    jobs, router = (sls["functions"][k]["environment"] for k in ("jobs", "router"))
    assert jobs["JOBS_CONFIG_TABLE"] == router["ROUTER_STATE_TABLE"]
    assert jobs["JOBS_STAGING"] == router["ROUTER_JOBS_STAGING"]


def test_asynchronous_invocations_have_dead_letter_queues(
    sam: dict[str, Any], sls: dict[str, Any]
) -> None:
    jobs = sam_function(sam, "JobsFunction")
    assert jobs["DeadLetterQueue"]["Type"] == "SQS"
    nightly = jobs["Events"]["Nightly"]["Properties"]
    assert "Arn" in nightly["DeadLetterConfig"]
    assert "onError" in sls["functions"]["jobs"]


def test_layer_pins_match_requirements() -> None:
    def pins(path: Path) -> dict[str, str]:
        lines = path.read_text(encoding="utf-8").splitlines()
        entries = [line.split("#")[0].strip() for line in lines]
        return dict(entry.split("==") for entry in entries if entry)

    root, layer = pins(ROOT / "requirements.txt"), pins(ROOT / "infra/lambda/requirements.txt")
    shared = set(root) & set(layer)
    assert shared, "the layer pins nothing from requirements.txt"
    assert {name: layer[name] for name in shared} == {name: root[name] for name in shared}
    heavy = {"onnxruntime", "tokenizers", "pillow", "opencv-python-headless", "pyclipper"}
    assert not heavy & set(layer)


def test_every_handler_imports(sam: dict[str, Any], tmp_path: Path) -> None:
    handlers = [sam_function(sam, name).get("Handler") for name in FUNCTIONS]
    handlers.append(sam_function(sam, "CpuInferFunction")["ImageConfig"]["Command"][0])
    modules = sorted({h.rsplit(".", 1)[0] for h in handlers if h})
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    assert callable(importlib.import_module(name).handler), name\n"
        "print('imported', len(sys.argv))\n"
    )
    env = {
        **os.environ,
        "CPU_REPOSITORY": str(tmp_path),  # an empty repository: nothing to load
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    env.pop("ROUTER_POLICY_PARAMETER", None)
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]


def test_zip_functions_need_nothing_outside_the_layer() -> None:
    # GIVEN an interpreter that cannot import what the layer leaves out
    script = (
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        blocked = {'onnxruntime', 'tokenizers', 'huggingface_hub', 'PIL', 'cv2',\n"
        "                   'pyclipper', 'shapely'}\n"
        "        if name.split('.')[0] in blocked:\n"
        "            raise ImportError(f'{name} is not in the Lambda layer')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import functions.router.handler, functions.jobs.handler\n"
    )
    env = {**os.environ, "AWS_DEFAULT_REGION": "us-east-1"}
    env.pop("ROUTER_POLICY_PARAMETER", None)
    # WHEN the router and jobs handlers are imported
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    # THEN they import
    assert result.returncode == 0, result.stderr[-2000:]


def test_default_policies_parse(sam: dict[str, Any]) -> None:
    sam_policy = sam["Resources"]["RouterPolicyParameter"]["Properties"]["Value"]
    sls_resources = yaml.safe_load(
        (ROOT / "infra/serverless-resources.yml").read_text(encoding="utf-8")
    )
    sls_policy = sls_resources["RouterPolicyParameter"]["Properties"]["Value"]
    assert json.loads(sam_policy) == json.loads(sls_policy)
    assert [rule.name for rule in parse_policy(sam_policy).rules][-1] == "default"


def _statements(node: Any, in_key_policy: bool = False) -> list[dict[str, Any]]:
    """Every IAM policy statement under ``node`` (KMS key policies excluded)."""
    found: list[dict[str, Any]] = []
    if isinstance(node, dict):
        if "Statement" in node and not in_key_policy:
            statements = node["Statement"]
            found += statements if isinstance(statements, list) else [statements]
        for key, value in node.items():
            if key == "AssumeRolePolicyDocument":
                continue
            found += _statements(value, in_key_policy or key == "KeyPolicy")
    elif isinstance(node, list):
        for item in node:
            found += _statements(item, in_key_policy)
    return found


@pytest.mark.parametrize("path", IAM_TEMPLATES)
def test_iam_is_least_privilege(path: str) -> None:
    statements = [s for s in _statements(load_cfn(ROOT / path)) if s.get("Effect") == "Allow"]
    for statement in statements:
        actions = (
            statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
        )
        for action in actions:
            assert action != "*", f"{path}: wildcard action"
            assert not action.endswith(":*"), f"{path}: wildcard {action}"
        resources = statement.get("Resource", [])
        resources = resources if isinstance(resources, list) else [resources]
        if "*" in resources:
            assert set(actions) <= STAR_RESOURCE_ACTIONS, f"{path}: {actions} on *"


DOCKERFILES = ["gpu_service/Dockerfile", "functions/cpu_infer/Dockerfile"]
_SECRET = re.compile(
    r"(AKIA[0-9A-Z]{16}|aws_secret_access_key|-----BEGIN [A-Z ]*PRIVATE KEY-----"
    r"|^\s*(ENV|ARG)\s+\S*(PASSWORD|SECRET|TOKEN|API_KEY)\S*)",
    re.IGNORECASE | re.MULTILINE,
)


@pytest.mark.parametrize("path", DOCKERFILES)
def test_dockerfile_rules(path: str) -> None:
    text = (ROOT / path).read_text(encoding="utf-8")
    bases = dockerfile_bases(text)
    assert bases
    for base in bases:
        assert "$" not in base, f"{base}: pin the base in the FROM line or its ARG default"
        assert "@sha256:" in base or re.search(r":[^:/]+$", base), f"{base}: no tag"
        assert not base.endswith(":latest"), f"{base}: latest is not a pin"
    users = re.findall(r"^USER\s+(\S+)", text, re.MULTILINE)
    if bases[-1].startswith("public.ecr.aws/lambda/"):
        # Lambda runs a function's image as its own unprivileged user; a USER line would
        # break `sam local invoke`, whose emulator layer runs RUN steps on the image.
        assert not users, "a Lambda image leaves the user to Lambda"
    else:
        assert users, "no USER instruction"
        assert users[-1].split(":")[0] not in {"root", "0"}
    assert not _SECRET.search(text)


@pytest.mark.skipif(
    not os.environ.get("SPILLWAY_SLS_PACKAGED"),
    reason="set by scripts/check_infra.sh after `serverless package`",
)
def test_packaged_serverless_matches_template(sam: dict[str, Any]) -> None:
    packaged = json.loads(Path(os.environ["SPILLWAY_SLS_PACKAGED"]).read_text(encoding="utf-8"))
    resources = packaged["Resources"]
    for sam_name, sls_key in FUNCTIONS.items():
        props, fn = sam_function(sam, sam_name), resources[SLS_LOGICAL[sls_key]]["Properties"]
        if props.get("PackageType") == "Image":
            assert fn["ImageConfig"]["Command"] == props["ImageConfig"]["Command"]
        else:
            assert fn["Handler"] == props["Handler"]
            assert fn["Runtime"] == props["Runtime"]
        assert fn["Architectures"] == ["x86_64"]
        assert int(fn["MemorySize"]) == int(sam_value(sam, props["MemorySize"]))
        assert set(fn["Environment"]["Variables"]) == sam_env_names(sam, sam_name)
        sam_reserved = sam_value(sam, props.get("ReservedConcurrentExecutions"))
        assert reserved(fn.get("ReservedConcurrentExecutions")) == reserved(sam_reserved)


def test_gpu_service_gets_its_admin_token_from_a_generated_secret() -> None:
    # GIVEN the ECS template (the container listens on 0.0.0.0, so repository control
    # needs GPU_ADMIN_TOKEN)
    resources = load_cfn(ROOT / "infra/ecs-gpu-service.yaml")["Resources"]
    secrets = [k for k, r in resources.items() if r["Type"] == "AWS::SecretsManager::Secret"]
    assert len(secrets) == 1
    secret = resources[secrets[0]]["Properties"]
    task = resources["TaskDefinition"]["Properties"]
    container = next(c for c in task["ContainerDefinitions"] if c["Name"] == "gpu-service")
    # THEN the token is generated by Secrets Manager, never written in the template
    assert secret["GenerateSecretString"]["PasswordLength"] >= 32
    assert "SecretString" not in secret
    # AND the container gets it as a secret (by ARN, which a Ref of the secret returns),
    # not as a plain environment variable
    assert {"Name": "GPU_ADMIN_TOKEN", "ValueFrom": {"Ref": secrets[0]}} in container["Secrets"]
    assert "GPU_ADMIN_TOKEN" not in {e["Name"] for e in container["Environment"]}
    assert {"Name": "GPU_HOST", "Value": "0.0.0.0"} in container["Environment"]
    # AND the execution role (which ECS uses to fetch container secrets) may read exactly
    # that secret: its full ARN, so the random suffix matches, and no other
    assert task["ExecutionRoleArn"] == {"Fn::GetAtt": ["ExecutionRole", "Arn"]}
    role = resources["ExecutionRole"]["Properties"]
    reads = [
        s
        for s in _statements(role["Policies"])
        if "secretsmanager:GetSecretValue" in _as_list(s["Action"])
    ]
    assert [(s["Effect"], s["Resource"]) for s in reads] == [("Allow", {"Ref": secrets[0]})]
    # AND only the task's startup reads it: the task role's one Secrets Manager read is
    # of the tenant scope proof key (the storage stack's), never of the admin token
    task_role = _statements(resources["TaskRole"]["Properties"]["Policies"])
    secret_reads = [
        (a, s["Resource"])
        for s in task_role
        for a in _as_list(s["Action"])
        if a.startswith("secretsmanager:")
    ]
    assert secret_reads == [("secretsmanager:GetSecretValue", SCOPE_PROOF_KEY_IMPORT)]


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


SCOPE_PROOF_KEY_IMPORT = {"Fn::ImportValue": {"Fn::Sub": "${StorageStack}-ScopeProofKeySecretArn"}}


def _secret_readers(resources: dict[str, Any], secret: Any) -> set[str]:
    """The roles whose policies allow ``secretsmanager:GetSecretValue`` on ``secret``."""
    return {
        name
        for name, resource in resources.items()
        if resource.get("Type") == "AWS::IAM::Role"
        for s in _statements(resource.get("Properties", {}))
        if s["Effect"] == "Allow"
        and "secretsmanager:GetSecretValue" in _as_list(s["Action"])
        and secret in _as_list(s["Resource"])
    }


def test_the_scope_proof_key_is_generated_and_read_by_the_router_and_backends_only(
    sam: dict[str, Any], sls: dict[str, Any]
) -> None:
    # GIVEN the storage stack, the GPU stack and both forms of the application
    storage = load_cfn(ROOT / "infra/storage.yaml")
    gpu = load_cfn(ROOT / "infra/ecs-gpu-service.yaml")["Resources"]
    sls_resources = SlsResolver(
        yaml.safe_load((ROOT / "serverless.yml").read_text(encoding="utf-8"))
    ).resolve(yaml.safe_load((ROOT / "infra/serverless-resources.yml").read_text("utf-8")))
    secret = storage["Resources"]["ScopeProofKeySecret"]["Properties"]
    # THEN Secrets Manager generates the key (never the template), under the storage key,
    # and the storage stack exports the secret's ARN (a Ref of a secret is its ARN)
    assert secret["GenerateSecretString"]["PasswordLength"] >= 64
    assert "SecretString" not in secret
    assert secret["KmsKeyId"] == {"Fn::GetAtt": ["Key", "Arn"]}
    output = storage["Outputs"]["ScopeProofKeySecretArn"]
    assert output["Value"] == {"Ref": "ScopeProofKeySecret"}
    assert output["Export"]["Name"] == {"Fn::Sub": "${AWS::StackName}-ScopeProofKeySecretArn"}
    # AND exactly the router's role (router and WebSocket functions), the CPU fallback's
    # role and the GPU service's task role may read it, in either application form
    assert _secret_readers(sam["Resources"], SCOPE_PROOF_KEY_IMPORT) == {
        "RouterRole",
        "CpuInferRole",
    }
    sls_import = {"Fn::ImportValue": "spillway-storage-ScopeProofKeySecretArn"}
    assert _secret_readers(sls_resources, sls_import) == {"RouterRole", "CpuInferRole"}
    assert _secret_readers(gpu, SCOPE_PROOF_KEY_IMPORT) == {"TaskRole"}
    # AND every process is told where it is, as the ARN in SCOPE_PROOF_SECRET_ID (read at run
    # time and again as it rotates, so never an ECS container secret)
    env = sam["Globals"]["Function"]["Environment"]["Variables"]
    assert env["SCOPE_PROOF_SECRET_ID"] == SCOPE_PROOF_KEY_IMPORT
    assert sls["provider"]["environment"]["SCOPE_PROOF_SECRET_ID"] == sls_import
    container = next(
        c
        for c in gpu["TaskDefinition"]["Properties"]["ContainerDefinitions"]
        if c["Name"] == "gpu-service"
    )
    variables = {e["Name"]: e["Value"] for e in container["Environment"]}
    assert variables["SCOPE_PROOF_SECRET_ID"] == SCOPE_PROOF_KEY_IMPORT
