"""Every Lambda function's environment fits Lambda's 4 KB, names and values together
(``spillway.aws.limits.LAMBDA_ENV_BYTES``; https://docs.aws.amazon.com/lambda/latest/dg/configuration-envvars.html),
as the templates read when the test runs, in two cases:

* ``defaults``: every stack deployed as docs/deploy.md deploys it (``tests.unit.stacks``),
  template.yaml with its parameters' defaults, serverless.yml for stage ``prod``;
* ``largest``: every parameter at the largest value it allows — the longest of its
  ``AllowedValues``; a ``Number`` at its ``MaxValue``, without one at
  ``UNBOUNDED_NUMBER_CHARS`` digits (every count the functions' settings accept is far
  shorter); a ``String`` at the shortest of its ``MaxLength``, the longest string its
  ``AllowedPattern`` matches and CloudFormation's 4,096-byte parameter value
  (https://docs.aws.amazon.com/AWSCloudFormation/latest/UserGuide/cloudformation-limits.html).
  A free-form JSON map (``IdentityTenants``: ``^\\{.*\\}$``) is therefore taken at
  4,096 bytes: nothing else bounds it. The storage stack's tunables (read through SSM)
  are at their largest too. serverless.yml's params take the bounds of their
  template.yaml counterpart (``identityTenants`` → ``IdentityTenants``, ``wsMaxInFlight``
  → ``WebSocketMaxInFlight`` …); a param without one keeps its ``prod`` value. Stack
  names, and the parameters that name other stacks (inside ``Fn::ImportValue``), keep
  the names docs/deploy.md gives them.
"""

from __future__ import annotations

import re
import re._parser as sre_parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest

from infra.checks.cfn_eval import Exports, Stack
from spillway.aws.limits import LAMBDA_ENV_BYTES
from tests.unit.stacks import SLS_STACK, deploy, serverless_config, serverless_template

CFN_PARAMETER_VALUE_BYTES = 4096
"""CloudFormation's largest parameter value."""
UNBOUNDED_NUMBER_CHARS = 20
"""What a ``Number`` parameter without ``MaxValue`` is taken to be (a 64-bit integer)."""
FUNCTION_TYPES = {"AWS::Serverless::Function", "AWS::Lambda::Function"}


@dataclass(frozen=True)
class Environment:
    """One function's environment, resolved."""

    where: str
    variables: Mapping[str, Any]

    @property
    def size(self) -> int:
        """Bytes of every name and value, as Lambda counts them."""
        return env_bytes(self.variables)


def env_bytes(variables: Mapping[str, Any]) -> int:
    """Bytes of the names and values (a value as CloudFormation writes it: ``false``)."""
    return sum(len(name.encode()) + len(_text(value).encode()) for name, value in variables.items())


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _pattern_width(pattern: str) -> int:
    """The longest string ``pattern`` matches (huge when unbounded)."""
    return int(sre_parse.parse(pattern).getwidth()[1])


def largest_value(declared: Mapping[str, Any]) -> str:
    """The largest value a parameter declaration allows (the module's rules)."""
    if "AllowedValues" in declared:
        return max((_text(v) for v in declared["AllowedValues"]), key=len)
    if declared.get("Type") == "Number":
        top = declared.get("MaxValue")
        return str(top) if top is not None else "9" * UNBOUNDED_NUMBER_CHARS
    width = CFN_PARAMETER_VALUE_BYTES
    if "MaxLength" in declared:
        width = min(width, int(declared["MaxLength"]))
    if "AllowedPattern" in declared:
        width = min(width, _pattern_width(str(declared["AllowedPattern"])))
    return "x" * width


def _imported_names(value: Any, inside: bool = False) -> Iterator[str]:
    """Parameters a template uses inside ``Fn::ImportValue`` (names of other stacks)."""
    if isinstance(value, dict):
        for key, item in value.items():
            now = inside or key == "Fn::ImportValue"
            if now and key == "Ref" and isinstance(item, str):
                yield item
            yield from _imported_names(item, now)
    elif isinstance(value, list):
        for item in value:
            yield from _imported_names(item, inside)
    elif inside and isinstance(value, str):
        yield from re.findall(r"\$\{([A-Za-z0-9]+)\}", value)


def largest_parameters(template: Mapping[str, Any]) -> dict[str, str]:
    """Every parameter at its largest, but those naming other stacks and those read from
    SSM (their values are another stack's)."""
    naming = set(_imported_names(template))
    return {
        name: largest_value(declared)
        for name, declared in template.get("Parameters", {}).items()
        if name not in naming and not str(declared.get("Type", "")).startswith("AWS::SSM::")
    }


def _sam_counterpart(param: str, sam: Mapping[str, Any]) -> str | None:
    """template.yaml's parameter for a serverless.yml param (``wsX`` → ``WebSocketX``)."""
    name = param[:1].upper() + param[1:]
    name = "WebSocket" + name[2:] if name.startswith("Ws") else name
    return name if name in sam.get("Parameters", {}) else None


def _function_envs(stack: Stack, where: str) -> list[Environment]:
    """The environment of every function in a CloudFormation stack (SAM's globals
    first, as the transform merges them)."""
    template = stack.template
    globals_ = template.get("Globals", {}).get("Function", {})
    common = globals_.get("Environment", {}).get("Variables", {})
    found = []
    for logical, resource in stack.resources.items():
        if resource.get("Type") not in FUNCTION_TYPES or not stack.included(logical):
            continue
        own = (resource.get("Properties") or {}).get("Environment", {}).get("Variables", {})
        sam = resource["Type"] == "AWS::Serverless::Function"
        variables = stack.resolve({**(common if sam else {}), **own})
        found.append(Environment(f"{where}:{logical}", variables))
    return found


def _sls_envs(config: Mapping[str, Any], stack: Stack) -> list[Environment]:
    """serverless.yml's functions (the provider's environment under each function's) and
    any function its resources (infra/serverless-*.yml) declare."""
    common = config["provider"].get("environment", {})
    envs = [
        Environment(f"serverless.yml:{key}", stack.resolve({**common, **fn.get("environment", {})}))
        for key, fn in config["functions"].items()
    ]
    declared = Stack(stack.name, {**stack.template, "Resources": config["resources"]["Resources"]},
                     stack.parameters, stack.exports)  # fmt: skip
    return envs + _function_envs(declared, "infra/serverless-resources.yml")


@cache
def environments(case: str) -> tuple[Environment, ...]:
    """Every function's environment in ``case`` (``defaults`` or ``largest``)."""
    deployed = deploy()
    if case == "defaults":
        found = [env for stack in deployed.all() for env in _function_envs(stack, stack.name)]
        config = serverless_config()
        return tuple(found + _sls_envs(config, deployed.sls))
    exports = Exports(deployed.sam.exports)
    storage = deployed.storage
    exports.publish(Stack(storage.name, storage.template, largest_parameters(storage.template),
                          exports))  # fmt: skip
    sam = deployed.sam.template
    big = largest_parameters(sam)
    stacks = [
        Stack(s.name, s.template, {**s.parameters, **largest_parameters(s.template)}, exports)
        for s in (deployed.network, deployed.gpu, deployed.batch, deployed.observability)
    ]
    stacks.append(Stack(deployed.sam.name, sam, big, exports))
    found = [env for stack in stacks for env in _function_envs(stack, stack.name)]
    prod = serverless_config()
    params = {
        param: big[counterpart]
        for param in _sls_params()
        if (counterpart := _sam_counterpart(param, sam)) is not None and counterpart in big
    }
    config = serverless_config(params)
    sls = Stack(SLS_STACK, serverless_template(config), {}, exports)
    assert prod["functions"].keys() == config["functions"].keys()
    return tuple(found + _sls_envs(config, sls))


def _sls_params() -> list[str]:
    import yaml

    from tests.unit.stacks import ROOT

    raw = yaml.safe_load((ROOT / "serverless.yml").read_text(encoding="utf-8"))
    return list(raw["params"]["default"])


def test_the_size_counts_names_and_values_as_lambda_does() -> None:
    # GIVEN two variables, one a boolean CloudFormation writes as "false"
    # THEN the size is every name's and value's bytes (UTF-8)
    assert env_bytes({"AB": "cd", "É": False}) == 2 + 2 + 2 + 5


def test_the_largest_values_follow_the_declarations() -> None:
    # GIVEN the kinds of declaration the templates use
    # THEN each is taken at the largest value it allows
    assert largest_value({"Type": "String", "AllowedValues": ["INFO", "WARNING"]}) == "WARNING"
    assert largest_value({"Type": "Number", "MaxValue": 1000}) == "1000"
    assert len(largest_value({"Type": "Number", "MinValue": 1})) == UNBOUNDED_NUMBER_CHARS
    assert len(largest_value({"Type": "String", "AllowedPattern": "^[a-z]{0,63}$"})) == 63
    assert len(largest_value({"Type": "String", "AllowedPattern": r"^\{.*\}$"})) == 4096
    assert len(largest_value({"Type": "String", "MaxLength": 10, "AllowedPattern": ".*"})) == 10


def test_every_template_and_function_is_measured() -> None:
    # THEN both templates' four functions are there in both cases
    for case in ("defaults", "largest"):
        where = {env.where.split(":")[-1] for env in environments(case)}
        assert {"RouterFunction", "WebSocketFunction", "CpuInferFunction", "JobsFunction"} <= where
        assert {"router", "websocket", "cpuInfer", "jobs"} <= where


@pytest.mark.parametrize("case", ["defaults", "largest"])
def test_every_functions_environment_fits_lambdas_4_kb(case: str) -> None:
    # GIVEN every function of every template, its parameters as the case says
    sizes = {env.where: env.size for env in environments(case)}
    # THEN each environment is within Lambda's 4 KB
    over = {
        env.where: (env.size, _largest_variables(env)) for env in environments(case)
        if env.size > LAMBDA_ENV_BYTES
    }  # fmt: skip
    assert not over, f"over {LAMBDA_ENV_BYTES} bytes ({case}): {over}; all sizes: {sizes}"


def _largest_variables(env: Environment) -> dict[str, int]:
    """The three variables that take the most room, with their bytes."""
    each = {name: env_bytes({name: value}) for name, value in env.variables.items()}
    return dict(sorted(each.items(), key=lambda item: -item[1])[:3])
