"""Tenant areas in S3 and the caller's identity: the core rules every store uses."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spillway.protocol.errors import InvalidInputError, OutsideTenantAreaError, UnauthenticatedError
from spillway.state.table import scope
from spillway.tenancy.areas import area, folder, require_inside
from spillway.tenancy.identity import Authenticator, authenticated_identity

ROOT = "s3://data/tenants"


def test_an_area_is_the_tenants_digest_under_the_root() -> None:
    assert area(ROOT, "team-a") == f"s3://data/tenants/{scope('team-a')}/"
    assert area(f"{ROOT}/", None) == "s3://data/tenants/-/"  # the anonymous tenant


@pytest.mark.parametrize(
    "location",
    [
        "s3://data/tenants/{a}",
        "s3://data/tenants/{a}/",
        "s3://data/tenants/{a}/in/",
        "s3://data/tenants/{a}/deep/er/x.jsonl",
    ],
)
def test_locations_inside_the_area_are_accepted(location: str) -> None:
    url = location.format(a=scope("team-a"))
    assert require_inside(url, [area(ROOT, "team-a")], "input") == folder(url)


@pytest.mark.parametrize(
    "location",
    [
        "s3://data/tenants/{b}/in/",  # another tenant
        "s3://data/tenants/{a}x/in/",  # a scope that starts like ours
        "s3://data/tenants/",  # the root itself
        "s3://data/async/{a}/",  # another feature's prefix
        "s3://data2/tenants/{a}/",  # another bucket
        "s3://models/repository/zz-injected/",
    ],
)
def test_locations_outside_the_area_are_403(location: str) -> None:
    url = location.format(a=scope("team-a"), b=scope("team-b"))
    with pytest.raises(OutsideTenantAreaError) as refused:
        require_inside(url, [area(ROOT, "team-a")], "output")
    assert (refused.value.status, refused.value.code) == (403, "outside_tenant_area")


@pytest.mark.parametrize("segment", ["..", ".", ""])
def test_dot_and_empty_segments_are_refused_outright(segment: str) -> None:
    url = f"{area(ROOT, 'team-a')}{segment}/x/"
    with pytest.raises(InvalidInputError):
        require_inside(url, [area(ROOT, "team-a")], "output")


@given(st.text(min_size=1, max_size=40), st.text(min_size=1, max_size=40))
def test_no_tenant_reaches_into_anothers_area(a: str, b: str) -> None:
    # GIVEN two different tenant names, whatever characters they hold
    if a == b:
        return
    # THEN neither area contains the other
    first, second = area(ROOT, a), area(ROOT, b)
    assert not first.startswith(second)
    assert not second.startswith(first)


def _event(**context: object) -> dict[str, object]:
    return {"headers": {"X-Spillway-Tenant": "claimed"}, "requestContext": context}


def test_the_authenticator_takes_the_routers_order() -> None:
    callers = Authenticator({"key-1": "team-a"})
    # an authorizer's tenant wins; then the API key id, mapped; then the IAM principal
    vouched = _event(authorizer={"tenant": "team-z"}, identity={"apiKeyId": "key-1"})
    assert callers.tenant(vouched) == "team-z"
    assert callers.tenant(_event(identity={"apiKeyId": "key-1"})) == "team-a"
    arn = "arn:aws:iam::123456789012:role/ci"
    assert callers.tenant(_event(identity={"userArn": arn})) == arn
    http_api = _event(authorizer={"iam": {"userArn": arn}})
    assert authenticated_identity(http_api) == arn
    # and nothing vouched: 401, the header notwithstanding
    with pytest.raises(UnauthenticatedError):
        callers.tenant(_event(identity={"apiKeyId": None}))


def test_hints_are_checked_where_they_are_trusted() -> None:
    callers = Authenticator(trust_tenant_hints=True)
    assert callers.tenant(_event()) == "claimed"
    with pytest.raises(InvalidInputError):
        callers.tenant({"headers": {"x-spillway-tenant": "a/b"}, "requestContext": {}})
