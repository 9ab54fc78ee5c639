"""Who is calling: the tenant API Gateway (or a trusted caller) vouches for.

One rule for the router and the jobs function. In order:

1. an authorizer's ``tenant`` (a Lambda authorizer's context, a JWT authorizer's claims,
   or the ``authorizer`` a trusted service puts in the event it invokes a function with:
   API Gateway builds ``requestContext`` itself, so no client can write it);
2. the identity API Gateway authenticated (a REST API key's id, else the IAM principal)
   through an ``identity_tenants`` map; an unmapped identity is its own tenant;
3. only where the deployment says so (local runs), the tenant a request names in the
   ``x-spillway-tenant`` header, and without one the anonymous tenant (``None``).

Anything else is ``UnauthenticatedError`` (401).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from spillway.protocol.errors import InvalidInputError, UnauthenticatedError

TENANT_HEADER = "x-spillway-tenant"
_TENANT = re.compile(r"^[A-Za-z0-9._:@-]{1,128}$")


def authorizer_tenant(authorizer: object) -> str | None:
    """``tenant`` from a Lambda authorizer's context or a JWT authorizer's claims."""
    if not isinstance(authorizer, dict):
        return None
    claims = (authorizer.get("jwt") or {}).get("claims")
    for scope in (authorizer, authorizer.get("lambda"), claims):
        if isinstance(scope, dict) and isinstance(scope.get("tenant"), str):
            return str(scope["tenant"])
    return None


def authenticated_identity(event: object) -> str | None:
    """The identity API Gateway authenticated: a REST API key's id, else the IAM
    principal (REST ``identity.userArn``, HTTP API ``authorizer.iam.userArn``)."""
    if not isinstance(event, dict):
        return None
    context = event.get("requestContext")
    if not isinstance(context, dict):
        return None
    identity = context.get("identity")
    iam = (
        (context.get("authorizer") or {}).get("iam")
        if isinstance(context.get("authorizer"), dict)
        else None
    )
    candidates = []
    if isinstance(identity, dict):
        candidates += [identity.get("apiKeyId"), identity.get("userArn")]
    if isinstance(iam, dict):
        candidates.append(iam.get("userArn"))
    return next((c for c in candidates if isinstance(c, str) and c), None)


def vouched_tenant(
    authorizer: object, event: object, identity_tenants: Mapping[str, str]
) -> str | None:
    """The tenant an authorizer set, else the authenticated identity's (mapped); ``None``
    when nothing vouched for the caller."""
    tenant = authorizer_tenant(authorizer)
    if tenant is not None:
        return tenant
    identity = authenticated_identity(event)
    if identity is None:
        return None
    return identity_tenants.get(identity, identity)


def tenant_hint(value: str | None) -> str | None:
    """A tenant a request names for itself, checked (1-128 letters, digits, ``._:@-``)."""
    if value is None or value == "":
        return None
    if not _TENANT.fullmatch(value):
        raise InvalidInputError("tenant must be 1-128 letters, digits or ._:@-")
    return value


@dataclass(frozen=True)
class Authenticator:
    """Resolves the tenant of an API Gateway proxy event (REST v1 or HTTP API v2)."""

    identity_tenants: Mapping[str, str] = field(default_factory=dict)
    trust_tenant_hints: bool = False
    """Local runs only: a caller nothing vouched for is the tenant its
    ``x-spillway-tenant`` header names, or the anonymous tenant without one."""

    def tenant(self, event: Mapping[str, object]) -> str | None:
        """The caller's tenant (``None``: anonymous, only with ``trust_tenant_hints``);
        ``UnauthenticatedError`` when nothing vouched for the caller."""
        context = event.get("requestContext")
        authorizer = context.get("authorizer") if isinstance(context, dict) else None
        tenant = vouched_tenant(authorizer, dict(event), self.identity_tenants)
        if tenant is not None:
            return tenant
        if self.trust_tenant_hints:
            return tenant_hint(event_header(event, TENANT_HEADER))
        raise UnauthenticatedError(
            "this API needs an authenticated caller (an API key or IAM credentials)"
        )


def event_header(event: Mapping[str, object], name: str) -> str | None:
    """A header of an API Gateway proxy event (REST v1 or HTTP API v2), its name matched
    in any case; absent, empty or not text: ``None``."""
    headers = event.get("headers")
    if not isinstance(headers, dict):
        return None
    wanted = name.lower()
    for key, value in headers.items():
        if isinstance(key, str) and key.lower() == wanted and isinstance(value, str) and value:
            return value
    return None
