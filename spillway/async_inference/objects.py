"""Request bodies and results in S3, inside the allow-list of tenant areas.

Every place a request names lies in its caller's own *area* (``spillway.tenancy.areas``:
``<root>/<scope>/``, one per root — ``<location>/inputs`` and each of ``input_prefixes``),
anything else is 403 ``outside_tenant_area``; an input that is not there is a 400
``input_not_found``. The server's own keys (``<location>/<id>/...``: staged bodies and
results) are in no tenant's area, and results go to keys the server chooses
(``<output>/<id>/result-<attempt>``), never to a key a request names. A location
whose keys would pass S3's 1,024 bytes (``spillway.aws.limits.S3_KEY_BYTES``; the result's name
counted) is a 400 ``invalid_input`` when the request is submitted: S3 would refuse the
write only after the run, and its answer would be lost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spillway.async_inference.records import AsyncRecord
from spillway.async_inference.settings import AsyncSettings
from spillway.aws.limits import S3_KEY_BYTES
from spillway.protocol.errors import InputNotFoundError, InvalidInputError, PayloadTooLargeError
from spillway.protocol.framing import BINARY_CONTENT_TYPE, HEADER_LENGTH
from spillway.protocol.messages import read_staged_request
from spillway.protocol.replies import Reply
from spillway.protocol.s3urls import parse_s3_url
from spillway.tenancy.areas import area, folder, require_inside

STAGED_NAME = "request.v2req"
RESULT_NAME_BYTES = len("result-") + 12
"""The name of a result in its request's output folder: ``result-<attempt's 12 hex>``."""
# S3's answers to a HEAD of a key that is not there: 404, or 403 for a caller without
# s3:ListBucket (the roles have none: they read keys they are told, never list).
_MISSING = frozenset({"404", "NoSuchKey", "NotFound", "403", "AccessDenied", "Forbidden"})


class AsyncObjects:
    """The S3 side of asynchronous requests: tenants' areas, staged bodies, results."""

    def __init__(self, settings: AsyncSettings, clients: Callable[[str], Any]) -> None:
        self.location = parse_s3_url(str(settings.location))
        self.max_input_bytes = settings.max_input_bytes
        own = folder(self.location.url)
        self.roots = [f"{own}inputs/", *(folder(p) for p in settings.input_prefixes)]
        for root in self.roots[1:]:
            # The server's own keys (<location>/<id>/...) are never in a tenant's area.
            if (own.startswith(root) or root.startswith(own)) and not root.startswith(
                self.roots[0]
            ):
                raise ValueError(f"ASYNC_INPUT_PREFIXES {root} overlaps ASYNC_LOCATION {own}")
        self._clients = clients

    def areas(self, tenant: str | None) -> list[str]:
        """The caller's own areas: where its ``input_location`` / ``output_location`` may
        point (``<root>/<scope>/`` of each root)."""
        return [area(root, tenant) for root in self.roots]

    def staged_url(self, rid: str) -> str:
        """Where the router stages a request's body (the server's own key)."""
        return f"s3://{self.location.bucket}/{self.location.key(rid, STAGED_NAME)}"

    def own_folder(self, rid: str) -> str:
        """The server's own folder of a request (its staged body, its default results)."""
        return f"s3://{self.location.bucket}/{self.location.key(rid)}/"

    def output_folder(self, rid: str, output_location: str | None, own: list[str]) -> str:
        """Where a request's results go: under its ``output_location`` (inside one of the
        caller's areas ``own``), else in the server's own folder."""
        if output_location is None:
            return self.own_folder(rid)
        output = f"{require_inside(output_location, own, 'output')}{rid}/"
        return _key_fits(output, "output_location", RESULT_NAME_BYTES)

    def input_place(self, url: str, own: list[str]) -> str:
        """An ``input_location``: an object strictly inside one of the caller's areas."""
        inside = require_inside(url, own, "input")
        if url.endswith("/") or inside in own:
            raise InvalidInputError(
                f"input_location must name an object inside your area ({', '.join(own)})"
            )
        return _key_fits(inside.rstrip("/"), "input_location")

    def check_input(self, source: str) -> dict[str, Any]:
        """The named input's HEAD: it is there (else 400 ``input_not_found``) and not
        too large (else 413)."""
        head = self._client_object(source, "head_object")
        if int(head["ContentLength"]) > self.max_input_bytes:
            raise PayloadTooLargeError(
                f"input_location holds {head['ContentLength']} bytes; the limit is "
                f"{self.max_input_bytes}"
            )
        return head

    def _client_object(self, source: str, operation: str) -> dict[str, Any]:
        """``head_object`` / ``get_object`` of a client's object; a missing (or unreadable)
        one is the client's ``InputNotFoundError``."""
        from spillway.aws.errors import ClientError, error_code

        place = parse_s3_url(source)
        try:
            answer: dict[str, Any] = getattr(self._clients("s3"), operation)(
                Bucket=place.bucket, Key=place.prefix
            )
        except ClientError as exc:
            if error_code(exc) not in _MISSING:
                raise
            raise InputNotFoundError(
                f"input_location {source[:200]!r} does not exist (or cannot be read)"
            ) from None
        return answer

    def stage(self, rid: str, staged: bytes) -> None:
        """Keep a request's body (``stage_request``'s form) under the server's own key."""
        self._clients("s3").put_object(
            Bucket=self.location.bucket, Key=self.location.key(rid, STAGED_NAME), Body=staged
        )

    def read_input(self, record: AsyncRecord) -> tuple[bytes, int | None]:
        """A record's request body and its header length (a staged ``.v2req``, else a V2
        body: binary when the object's metadata names a header length)."""
        place = parse_s3_url(record.input)
        if record.input == self.staged_url(record.id):
            # The body the router staged: its absence is the server's fault (retried).
            s3 = self._clients("s3")
            head = s3.head_object(Bucket=place.bucket, Key=place.prefix)
            data = s3.get_object(Bucket=place.bucket, Key=place.prefix)["Body"].read()
        else:
            # The client's own object: gone since it was submitted, that is the client's
            # failure (recorded once: no retry, no dead letter).
            head = self.check_input(record.input)
            data = self._client_object(record.input, "get_object")["Body"].read()
        if place.prefix.endswith(".v2req"):
            return read_staged_request(data)
        length = (head.get("Metadata") or {}).get(HEADER_LENGTH)
        from spillway.protocol.framing import parse_header_length

        return data, parse_header_length(length)

    def write_result(self, record: AsyncRecord, token: str, reply: Reply) -> str:
        """The result object of the attempt ``token`` (its own key: a late attempt never
        overwrites what the record points at); its S3 URL."""
        place = parse_s3_url(folder(record.output))
        key = f"{place.prefix}result-{token}"
        headers = dict(reply.headers)
        metadata = {}
        if HEADER_LENGTH in headers:
            metadata[HEADER_LENGTH] = headers[HEADER_LENGTH]
        self._clients("s3").put_object(
            Bucket=place.bucket,
            Key=key,
            Body=reply.body,
            ContentType=headers.get("content-type", BINARY_CONTENT_TYPE),
            Metadata=metadata,
        )
        return f"s3://{place.bucket}/{key}"

    def read(self, url: str) -> bytes:
        """The bytes of an object the server wrote (a result)."""
        place = parse_s3_url(url)
        body: bytes = (
            self._clients("s3").get_object(Bucket=place.bucket, Key=place.prefix)["Body"].read()
        )
        return body

    def delete_own(self, record: AsyncRecord) -> None:
        """Delete an expired request's objects in the server's own folder (never a
        client's object)."""
        own = self.own_folder(record.id)
        for url in {record.input, record.result or ""} - {""}:
            if url.startswith(own):
                place = parse_s3_url(url)
                self._clients("s3").delete_object(Bucket=place.bucket, Key=place.prefix)


def _key_fits(url: str, what: str, name_bytes: int = 0) -> str:
    """``url``, when the longest object the server puts there (``name_bytes`` more) has a
    key S3 takes (1,024 bytes of UTF-8) and a URL ``parse_s3_url`` reads back (1,024
    characters); else the client's 400, before anything is written."""
    longest = url + "-" * name_bytes
    size = len(longest.removeprefix("s3://").partition("/")[2].encode())
    if size > S3_KEY_BYTES or len(longest) > S3_KEY_BYTES:
        raise InvalidInputError(
            f"{what} is too long: an object under it would have a {size}-byte key "
            f"({len(longest)} characters as a URL); S3 and this service allow {S3_KEY_BYTES}"
        )
    return url
