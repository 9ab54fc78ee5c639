"""What the mutation run of spillway/protocol/wire.py found reached by no wire test
(docs/mutation.md): the tenant scope header taken apart, and the fixed GET routes' 404
and 405."""

from __future__ import annotations

import pytest

from spillway.protocol.errors import InvalidInputError, MethodNotAllowedError, RouteNotFoundError
from spillway.protocol.wire import ScopeClaim, allow_get, read_scope_claim

SCOPE = "0123456789abcdef" * 2
SIGNATURE = "ab" * 32


@pytest.mark.parametrize(
    ("value", "claim"),
    [
        (None, None),
        ("-", ScopeClaim("-", None, None)),
        (SCOPE, ScopeClaim(SCOPE, None, None)),
        (f"{SCOPE}.1800000000.{SIGNATURE}", ScopeClaim(SCOPE, 1_800_000_000, SIGNATURE)),
        (f"-.7.{SIGNATURE}", ScopeClaim("-", 7, SIGNATURE)),
    ],
    ids=["absent", "anonymous", "scope", "scope-with-proof", "anonymous-with-proof"],
)
def test_a_scope_header_is_taken_apart(value: str | None, claim: ScopeClaim | None) -> None:
    read = read_scope_claim(value)
    assert read == claim
    if read is not None:
        assert isinstance(read.expiry, int | None)


@pytest.mark.parametrize(
    "value",
    [
        "",
        "acme",
        SCOPE.upper(),
        f"{SCOPE}.",
        f"{SCOPE}.12.{SIGNATURE[:-1]}",
        f"{SCOPE}.x.{SIGNATURE}",
    ],
)
def test_a_scope_header_that_is_no_scope_is_refused_with_its_form(value: str) -> None:
    with pytest.raises(InvalidInputError) as refused:
        read_scope_claim(value)
    assert refused.value.message == (
        "x-spillway-tenant-scope must be - or 32 lower-case hex digits, "
        "optionally followed by the router's .<expiry>.<signature>"
    )


ROUTES = frozenset({"/v2/health/ready", "/metrics"})


def test_a_fixed_get_route_answers_get() -> None:
    allow_get("GET", "/metrics", ROUTES)  # raises on a refusal
    allow_get("GET", "/v2/health/ready", ROUTES)


def test_a_fixed_get_route_with_another_method_is_405_naming_get() -> None:
    with pytest.raises(MethodNotAllowedError) as refused:
        allow_get("POST", "/v2/health/ready", ROUTES)
    assert refused.value.message == "POST is not allowed on /v2/health/ready"
    assert refused.value.allow == "GET"


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_a_path_that_is_no_route_is_404_whatever_the_method(method: str) -> None:
    with pytest.raises(RouteNotFoundError) as refused:
        allow_get(method, "/v2/model/m/infer", ROUTES)
    assert refused.value.message == "no route for /v2/model/m/infer"
