"""IAM statements of a stack, resolved to concrete ARNs, matched the way IAM matches them.

IAM compares an ARN with a policy's ``Resource`` as a glob: ``*`` matches any run of
characters (``:`` and ``/`` included), ``?`` one character, and the comparison is
case-sensitive; action names compare the same way but case-insensitively. A pattern such
as ``${Group.Arn}:log-stream:*`` is valid IAM, so no linter flags it, yet a log group's
``Arn`` already ends in ``:*`` and the pattern matches no stream a service ever writes to.
Only evaluating the resolved pattern against the real ARN shows it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from infra.checks.cfn_eval import Stack

# Resource policies (the statements belong to the resource, not to a role).
RESOURCE_POLICIES = {
    "AWS::SQS::QueuePolicy",
    "AWS::S3::BucketPolicy",
    "AWS::SNS::TopicPolicy",
}


@dataclass(frozen=True)
class Statement:
    """One resolved policy statement and who holds it (a role or a resource policy)."""

    owner: str
    sid: str
    effect: str
    actions: tuple[str, ...]
    resources: tuple[str, ...]
    conditional: bool


@lru_cache(maxsize=1024)
def _glob(pattern: str, case_sensitive: bool) -> re.Pattern[str]:
    parts = [".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern]
    return re.compile("".join(parts), 0 if case_sensitive else re.IGNORECASE | re.DOTALL)


def glob_matches(pattern: str, value: str, *, case_sensitive: bool = True) -> bool:
    """Whether IAM's wildcard ``pattern`` matches ``value`` as a whole."""
    return _glob(pattern, case_sensitive).fullmatch(value) is not None


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _documents(stack: Stack) -> Iterable[tuple[str, dict[str, Any]]]:
    """(owner, policy document) of every identity and resource policy in the stack."""
    for logical, resource in stack.resources.items():
        if not stack.included(logical):
            continue
        kind, props = resource["Type"], resource.get("Properties") or {}
        if kind == "AWS::IAM::Role":
            for policy in props.get("Policies", []):
                yield logical, policy["PolicyDocument"]
        elif kind in ("AWS::IAM::Policy", "AWS::IAM::ManagedPolicy"):
            for role in props.get("Roles", []):
                yield (role["Ref"] if isinstance(role, dict) else role), props["PolicyDocument"]
        elif kind in RESOURCE_POLICIES:
            yield logical, props["PolicyDocument"]
        elif kind == "AWS::Serverless::Function" and "Policies" in props:
            raise NotImplementedError(f"{logical}: SAM policy templates are not modelled")


def statements(stack: Stack) -> list[Statement]:
    """Every policy statement of the stack with its actions and resources resolved."""
    found = []
    for owner, document in _documents(stack):
        for index, raw in enumerate(_as_list(document["Statement"])):
            if "NotAction" in raw or "NotResource" in raw:
                raise NotImplementedError(f"{owner}: NotAction/NotResource are not modelled")
            found.append(
                Statement(
                    owner=owner,
                    sid=raw.get("Sid", f"#{index}"),
                    effect=raw["Effect"],
                    actions=tuple(stack.resolve(_as_list(raw["Action"]))),
                    resources=tuple(stack.resolve(_as_list(raw.get("Resource", [])))),
                    conditional="Condition" in raw,
                )
            )
    return found


def _applies(statement: Statement, action: str, resource: str) -> bool:
    return any(glob_matches(a, action, case_sensitive=False) for a in statement.actions) and any(
        glob_matches(r, resource) for r in statement.resources
    )


def allowed(found: Iterable[Statement], owner: str, action: str, resource: str) -> bool:
    """Whether ``owner``'s statements allow ``action`` on ``resource`` (an unconditional
    Deny wins; a conditional Deny, such as TLS-only, does not apply to a TLS call)."""
    own = [s for s in found if s.owner == owner]
    if any(s.effect == "Deny" and not s.conditional and _applies(s, action, resource) for s in own):
        return False
    return any(s.effect == "Allow" and _applies(s, action, resource) for s in own)


@dataclass(frozen=True)
class Universe:
    """The ARNs the stacks' resources are known by, and the prefixes of their children."""

    arns: frozenset[str]
    children: tuple[str, ...]

    def covers(self, pattern: str) -> bool:
        """Whether ``pattern`` can match an ARN of some resource: one of their ARNs, or a
        child ARN (an object of a bucket, a version of a function) under its prefix."""
        if any(glob_matches(pattern, known) for known in self.arns):
            return True
        literal = re.split(r"[*?]", pattern, maxsplit=1)[0]
        return any(literal.startswith(prefix) for prefix in self.children)


def universe(stacks: Iterable[Stack]) -> Universe:
    """Every resource ARN (and child prefix) of ``stacks``."""
    arns: set[str] = set()
    children: list[str] = []
    for stack in stacks:
        for logical in stack.resources:
            if stack.included(logical):
                identity = stack.identity(logical)
                arns.update(identity.arns)
                children.extend(identity.children)
    return Universe(frozenset(arns), tuple(children))
