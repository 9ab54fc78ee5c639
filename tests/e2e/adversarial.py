"""Adversarial requests and the one check every answer must pass (no tests here).

The strategies build whole HTTP requests — method, path, headers, body — from the parts a
hostile or broken client gets wrong: tensor shapes (many, zero, huge and negative
dimensions), numbers at and beyond float range, invalid UTF-8 and lone surrogates, binary
framing that lies (``Inference-Header-Content-Length`` and ``binary_data_size``),
oversized parameters and path tricks. Bodies are JSON text written here, so literals no
encoder would write (``1e999``, a 400-digit integer, ``"\\ud800"``) reach the server.
The cases come from seeded generators (``tests/e2e/gen.py``): the same on every run.

``Client`` keeps one HTTP/1.1 connection alive across cases; ``check_answer`` is the
contract: a 2xx or 4xx, never a 5xx; every 4xx is ``{"error": str, "code": str}``; every
2xx body is well-formed JSON (or, for a binary infer answer, a JSON header of the length
it declares).

The slow-client family (``Attack``) opens raw connections that stall or starve a server:
heads dripped a byte at a time, bodies that stop, ``Expect: 100-continue`` then silence,
and pipelined requests whose answers are never read. ``Attack.wait_closed`` waits for
the server to close each one without reading from it (a read would be progress).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import numpy as np

from tests.e2e import gen as st

TIMEOUT_S = 30.0
"""A case that gets no answer within this is a hang, and fails."""

# --- JSON text with literals no encoder writes ------------------------------------------


@dataclass(frozen=True)
class Raw:
    """A JSON fragment written as it is (``1e999``, ``NaN``, ``"\\ud800"``, ``-0``)."""

    text: str


def to_json(value: Any) -> str:
    """JSON text of ``value``; ``Raw`` parts are written verbatim (keys included)."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        items = (f"{_key(k)}:{to_json(v)}" for k, v in value.items())
        return "{" + ",".join(items) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(to_json(v) for v in value) + "]"
    return json.dumps(value)


def _key(key: Any) -> str:
    return key.text if isinstance(key, Raw) else json.dumps(str(key))


# --- values -----------------------------------------------------------------------------

EDGE_NUMBERS = [
    "0",
    "-0",
    "1",
    "-1",
    "0.5",
    "1e308",
    "-1e308",
    "1.7976931348623157e308",
    "1.7976931348623159e308",  # rounds past the largest double
    "1e309",
    "-1e309",
    "1e-400",
    "3.4028235e38",
    "3.5e38",  # past float32
    "-3.5e38",
    "65504",
    "65520",  # past float16
    "2147483647",
    "2147483648",
    "-2147483649",
    "9223372036854775807",
    "9223372036854775808",
    "-9223372036854775809",
    "18446744073709551616",
    "1" + "0" * 400,
    "-" + "9" * 400,
    "1" * 5000,  # past Python's integer-string digit limit
    "NaN",
    "Infinity",
    "-Infinity",
    '"NaN"',
    '"inf"',
    '"-Infinity"',
    '"1e999"',
    "1E400",
    "123456789012345678901234567890.5",
]

EDGE_STRINGS = [
    '""',
    '"\\ud800"',  # a lone high surrogate
    '"\\udfff"',
    '"a\\ud83d"',
    '"\\ud83d\\ude00"',  # a valid pair
    '"\\u0000"',
    '"\\u202e"',
    '"%2F"',
    '"../../etc/passwd"',
    '"digits"',
    '"FP32"',
    '"BYTES"',
    '"s3://bucket/x"',
    json.dumps("x" * 70_000),  # past the longest BYTES element
]


def _raw_int(value: int) -> Raw:
    return Raw(str(value))


numbers = (
    st.sampled_from(EDGE_NUMBERS).map(Raw)
    | st.integers(min_value=-(2**70), max_value=2**70).map(_raw_int)
    | st.floats().map(lambda f: Raw(repr(f)))
)
strings = st.sampled_from(EDGE_STRINGS).map(Raw) | st.text(max_size=12)
scalars = numbers | strings | st.sampled_from([True, False, None])
junk = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    depth=2,
)

dimension = st.one_of(
    st.integers(min_value=0, max_value=70),
    st.sampled_from([0, 1, 8, 64, 65, 2**31, 2**32, 2**53, 2**63 - 1, 2**63, 2**64, 10**30]),
    st.integers(min_value=-(2**64), max_value=-1),
    st.sampled_from([Raw("1.5"), Raw("8.0"), Raw('"8"'), Raw("true"), Raw("null"), Raw("1e999")]),
)
shapes = st.one_of(
    st.lists(dimension, max_size=8),
    st.lists(st.integers(min_value=0, max_value=2), min_size=9, max_size=80),  # many dims
    st.sampled_from([[1, 8, 8], [2, 8, 8], [0, 8, 8], [1, 0, 8], [64, 8, 8], [65, 8, 8]]),
    junk,
)
DATATYPES = ["FP32", "FP16", "FP64", "INT64", "INT32", "INT8", "UINT8", "BOOL", "BYTES", "BF16"]
datatypes = st.sampled_from(DATATYPES) | st.sampled_from(["fp32", "FLOAT", "", "TYPE_FP32"]) | junk

ELEMENT_BYTES = {"FP32": 4, "FP16": 2, "FP64": 8, "INT64": 8, "INT32": 4, "INT8": 1}
PARAMETER_KEYS = [
    "timeout",
    "priority",
    "latency_budget_ms",
    "mode",
    "tenant",
    "binary_data_output",
    "binary_data_size",
    "sequence_id",
]
parameter_values = st.one_of(
    numbers,
    st.sampled_from(["gpu", "cpu", "batch", "auto", "fast", "", "GPU"]),
    st.sampled_from([3_600_000_000, 3_600_000_001, 1_000_000, 1_000_001, 2**63, 10**40]).map(
        _raw_int
    ),
    junk,
)
parameters = st.one_of(
    st.dictionaries(st.sampled_from(PARAMETER_KEYS), parameter_values, max_size=4),
    st.dictionaries(st.text(max_size=8), junk, max_size=3),
    junk,
)


# --- requests ---------------------------------------------------------------------------


@dataclass
class Request:
    """One HTTP request to send."""

    method: str
    path: str
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""

    def __repr__(self) -> str:  # what a failing case prints
        body = self.body[:600]
        return f"Request({self.method} {self.path[:300]!r} headers={self.headers} body={body!r})"


def _encode_segment(text: str) -> str:
    return quote(text, safe="")


SEGMENT_TRICKS = [
    "digits",
    "minilm",
    "..",
    ".",
    "%2e%2e",
    "%2E%2E%2F%2E%2E",
    "digits%2Finfer",
    "%2F",
    "%00",
    "%ff%fe",
    "%c0%ae%c0%ae",  # overlong '..'
    "%ed%a0%80",  # an encoded surrogate
    "%E2%80%AE",
    "d%C3%AFgits",
    "DIGITS",
    "digits%09",
    "digits%20",
    "-digits",
    "a" * 64,
    "a" * 65,
    "a" * 5000,
    "stats",
    "%",
    "%zz",
    "~",
    "digits;x",
]
segments = st.sampled_from(SEGMENT_TRICKS) | st.text(min_size=0, max_size=20).map(_encode_segment)
VERSIONS = ["1", "2", "0", "-1", "01", "1.0", "1e3", "99999999999999999999", "", "%2e%2e", "x"]
versions = st.sampled_from(VERSIONS) | st.integers(min_value=-(2**70), max_value=2**70).map(str)
OPS = ["infer", "ready", "config", "stats", "", "load", "INFER", "infer/", "metadata"]


@st.composite
def model_paths(draw: st.Draw, names: list[str]) -> str:
    """``/v2/models/...`` with a known or tricky name, maybe a version, maybe an op."""
    name = draw(st.sampled_from(names) | segments)
    path = f"/v2/models/{name}"
    if draw(st.booleans()):
        path += f"/versions/{draw(versions)}"
    op = draw(st.sampled_from(OPS))
    return f"{path}/{op}" if op else path


def other_paths(extra: list[str]) -> st.Gen[str]:
    """Everything that is not a model path: known routes, their neighbours, tricks."""
    known = [
        "/",
        "/v2",
        "/v2/",
        "/v2/health/live",
        "/v2/health/ready",
        "/v2/health",
        "/v2/models",
        "/v2/models/",
        "/v2/models/stats",
        "/v2//models/digits",
        "/v2/models//infer",
        "/v2/repository/index",
        "/v2/repository/models/digits/load",
        "/v2/repository/models/../load",
        "/v2/repository/models/%2e%2e/unload",
        "/metrics",
        "/openapi.json",
        "/%2e%2e/%2e%2e/etc/passwd",
        "/v2/models/digits/../../v2",
        "/local/v2/models/digits",
        "/" + "a" * 8000,
        *extra,
    ]
    return st.sampled_from(known) | st.lists(segments, max_size=5).map(lambda p: "/" + "/".join(p))


@st.composite
def tensor(draw: st.Draw, names: list[str]) -> tuple[dict[Any, Any], bytes]:
    """One input tensor (JSON header part) and the binary bytes it may point at."""
    t: dict[Any, Any] = {}
    if draw(st.integers(0, 9)):
        t["name"] = draw(st.sampled_from(names) | strings)
    shape = draw(shapes)
    if draw(st.integers(0, 9)):
        t["shape"] = shape
    datatype = draw(datatypes)
    if draw(st.integers(0, 9)):
        t["datatype"] = datatype
    count = _count(shape)
    binary = b""
    how = draw(st.sampled_from(["data", "binary", "binary-lie", "none", "junk"]))
    if how == "data":
        size = count if count is not None and count <= 4096 else draw(st.integers(0, 70))
        # A few drawn values tiled to the size: drawing thousands one by one is slow.
        values = draw(st.lists(numbers | st.floats(0, 16), min_size=1, max_size=4))
        t["data"] = (values * (size // len(values) + 1))[:size]
    elif how in ("binary", "binary-lie"):
        width = ELEMENT_BYTES.get(datatype, 4) if isinstance(datatype, str) else 4
        real = (count if count is not None and count <= 4096 else 64) * width
        binary = bytes(draw(st.binary(min_size=0, max_size=32))) * (real // 32 + 1)
        binary = binary[:real] if binary else b"\0" * real
        declared: Any = len(binary)
        if how == "binary-lie":
            declared = draw(
                st.sampled_from([len(binary) + 1, len(binary) - 1, 0, -1, 2**63, 10**30])
                | numbers
                | junk
            )
        t["parameters"] = {"binary_data_size": declared}
        if draw(st.integers(0, 9)) == 0:
            t["data"] = [1.0]  # both data and binary
    elif how == "junk":
        t["data"] = draw(junk)
        if draw(st.booleans()):
            t["parameters"] = draw(parameters)
    return t, binary


def _count(shape: Any) -> int | None:
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        return None
    total = 1
    for d in shape:
        total *= d
    return total


def digits_json(rows: int = 1) -> dict[str, Any]:
    """A valid digits request (the baseline the mutations start from)."""
    return {
        "inputs": [
            {"name": "image", "shape": [rows, 8, 8], "datatype": "FP32", "data": [1.0] * rows * 64}
        ]
    }


@st.composite
def infer_body(draw: st.Draw, input_names: list[str]) -> tuple[dict[str, str], bytes]:
    """Headers and body of an infer request: JSON or binary, framing honest or not."""
    header: dict[Any, Any] = {}
    binaries: list[bytes] = []
    if draw(st.integers(0, 9)):
        inputs = []
        for _ in range(draw(st.integers(0, 3))):
            t, b = draw(tensor(input_names))
            inputs.append(t)
            binaries.append(b)
        header["inputs"] = inputs if draw(st.integers(0, 9)) else draw(junk)
    if draw(st.booleans()):
        header["parameters"] = draw(parameters)
    if draw(st.integers(0, 3)) == 0:
        outputs = st.fixed_dictionaries(
            {"name": st.sampled_from(["label", "probabilities", "x"]) | strings},
            optional={"parameters": parameters},
        )
        header["outputs"] = draw(st.lists(outputs, max_size=3) | junk)
    if draw(st.integers(0, 4)) == 0:
        header["id"] = draw(strings | numbers)
    if draw(st.integers(0, 6)) == 0:
        header[draw(st.sampled_from(EDGE_STRINGS).map(Raw))] = draw(junk)
    text = to_json(header).encode("utf-8", "surrogatepass")
    headers: dict[str, str] = {}
    framing = draw(st.sampled_from(["json", "json", "binary", "binary-lie", "header-junk"]))
    tail = b"".join(binaries)
    if framing == "json":
        body = text
    else:
        body = text + tail + draw(st.binary(max_size=16))
        length: Any = len(text)
        if framing == "binary-lie":
            length = draw(st.sampled_from([len(text) + 1, len(text) - 1, len(body) + 1, 0, 10**13]))
        elif framing == "header-junk":
            length = draw(
                st.sampled_from(["", " ", "-1", "+5", "1_0", "0x10", "\u0663", "1e3", "nan"])
                | st.text(max_size=6)
            )
        headers["Inference-Header-Content-Length"] = str(length)
    return headers, draw(_mangle(body))


@st.composite
def _mangle(draw: st.Draw, body: bytes) -> bytes:
    """Sometimes break the body's bytes: invalid UTF-8, truncation, NUL, nesting."""
    how = draw(st.integers(0, 19))
    if how == 0 and body:
        cut = draw(st.integers(0, len(body)))
        return body[:cut]
    if how == 1:
        at = draw(st.integers(0, len(body)))
        bad: bytes = draw(
            st.sampled_from([b"\xff", b"\xc0\xae", b"\xed\xa0\x80", b"\x00", b"\x80"])
        )
        return body[:at] + bad + body[at:]
    if how == 2:
        return b"[" * 100_000  # nesting deeper than the parser's recursion limit
    if how == 3:
        return bytes(draw(st.binary(max_size=64)))
    if how == 4:
        return b'{"inputs":' + b"1" * 5000 + b"}"
    return body


@st.composite
def near_valid_infer(draw: st.Draw) -> tuple[dict[str, str], bytes]:
    """A valid digits request with one or two things changed, so the cases reach the
    batcher, deadlines, priorities and output encoding, not only the first check."""
    rows = draw(st.sampled_from([1, 1, 2, 3, 16, 64, 65, 0]))
    count = rows * 64
    values: list[Any] = [
        float(v) for v in draw(st.lists(st.integers(0, 16), min_size=1, max_size=8))
    ]
    data: list[Any] = (values * (count // len(values) + 1))[:count]
    if data and draw(st.integers(0, 3)) == 0:
        data[draw(st.integers(0, len(data) - 1))] = draw(numbers)
    image: dict[str, Any] = {"name": "image", "shape": [rows, 8, 8], "datatype": "FP32"}
    if draw(st.integers(0, 3)) == 0:
        image["datatype"] = draw(
            st.sampled_from(["FP16", "FP64", "INT64", "INT8", "BOOL", "BYTES"])
        )
    if draw(st.integers(0, 3)) == 0:
        image["shape"] = draw(shapes)
    header: dict[Any, Any] = {"inputs": [image]}
    if draw(st.booleans()):
        header["parameters"] = draw(
            st.dictionaries(st.sampled_from(PARAMETER_KEYS), parameter_values, max_size=3)
        )
    if draw(st.integers(0, 2)) == 0:
        flags = st.fixed_dictionaries(
            {},
            optional={
                "binary_data": st.booleans() | junk,
                "classification": st.integers(-2, 12) | junk,
            },
        )
        names = st.sampled_from(["label", "probabilities", "nope"])
        outputs = st.fixed_dictionaries({"name": names}, optional={"parameters": flags})
        header["outputs"] = draw(st.lists(outputs, max_size=3))
    headers: dict[str, str] = {}
    if draw(st.booleans()):
        image["data"] = data
        return headers, to_json(header).encode()
    raw = np.asarray([v if isinstance(v, float) else 0.0 for v in data], dtype=np.float32).tobytes()
    size: Any = len(raw)
    if draw(st.integers(0, 2)) == 0:
        size = draw(st.sampled_from([len(raw) + 4, len(raw) - 4, 0, -1, 2**64]) | numbers)
    image["parameters"] = {"binary_data_size": size}
    text = to_json(header).encode()
    length: Any = len(text)
    if draw(st.integers(0, 3)) == 0:
        length = draw(st.sampled_from([len(text) - 1, len(text) + 1, 0, len(text) + len(raw)]))
    headers["Inference-Header-Content-Length"] = str(length)
    return headers, text + raw


HEADER_TRICKS = {
    "X-Spillway-Mode": st.sampled_from(["gpu", "cpu", "batch", "auto", "x", ""]),
    "X-Spillway-Latency-Budget-Ms": st.sampled_from(
        ["0", "-1", "1e309", "nan", "inf", "1" * 400, "5", "x", ""]
    ),
    "X-Spillway-Priority": st.sampled_from(["0", "1", "-1", "99999999999999999999", "x"]),
    "X-Spillway-Tenant": st.sampled_from(["a", "", "premium", "\u00e9" * 3, "x" * 500]),
    "X-Request-Id": st.sampled_from(["abc", "a" * 200, "../x", ""]),
    "Idempotency-Key": st.sampled_from(["k", "x" * 300, ""]),
    "Content-Type": st.sampled_from(
        ["application/json", "application/octet-stream", "text/plain", "x/y; charset=utf-16"]
    ),
    "Authorization": st.sampled_from(["Bearer x", "", "Basic Zm9vOmJhcg=="]),
}


@st.composite
def extra_headers(draw: st.Draw) -> dict[str, str]:
    """A few of the headers a server or router reads, with bad values."""
    chosen = draw(st.lists(st.sampled_from(sorted(HEADER_TRICKS)), max_size=3, unique=True))
    return {name: draw(HEADER_TRICKS[name]) for name in chosen}


METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]


@st.composite
def inference_requests(
    draw: st.Draw, models: list[str], inputs: list[str], extra_paths: list[str]
) -> Request:
    """A request against an Open Inference Protocol server (GPU, CPU fallback, router)."""
    kind = draw(st.integers(0, 9))
    if kind < 3:  # a valid request with a twist reaches the deepest code
        headers, body = draw(near_valid_infer())
        return Request(
            "POST", "/v2/models/digits/infer", {**headers, **draw(extra_headers())}, body
        )
    if kind < 6:  # most effort goes to infer
        name = draw(st.sampled_from(models)) if draw(st.integers(0, 4)) else draw(segments)
        path = f"/v2/models/{name}"
        if draw(st.integers(0, 3)) == 0:
            path += f"/versions/{draw(versions)}"
        headers, body = draw(infer_body(inputs))
        method = "POST" if draw(st.integers(0, 9)) else draw(st.sampled_from(METHODS))
        return Request(method, path + "/infer", {**headers, **draw(extra_headers())}, body)
    path = draw(model_paths(models)) if kind < 8 else draw(other_paths(extra_paths))
    method = draw(st.sampled_from(["GET", "GET", "GET", *METHODS]))
    body = draw(st.sampled_from([b"", b"{}", b"\xff", b"[1,2]"])) if method != "GET" else b""
    return Request(method, path, draw(extra_headers()), body)


# --- the jobs API -----------------------------------------------------------------------

S3_URLS = [
    "s3://bucket/in/",
    "s3://b/x",
    "s3://" + "a" * 70 + "/x",
    "s3://Bad_Bucket/x",
    "s3://bucket..x/y",
    "s3://bucket\\x/y",
    "s3://",
    "http://bucket/x",
    "s3://bucket/" + "k" * 1100,
    "s3://bucket/%2e%2e/x",
]
jobs_fields = {
    "model": st.sampled_from(["digits", "minilm", "nope", "", "../x", "a" * 65]) | strings,
    "version": numbers | junk,
    "input": st.sampled_from(S3_URLS) | strings,
    "output": st.sampled_from(S3_URLS) | strings,
    "shards": numbers | junk,
    "batch_size": numbers | junk,
}


@st.composite
def job_requests(draw: st.Draw) -> Request:
    """``POST /v1/jobs`` with a bad body, or ``GET /v1/jobs/{id}`` with a tricky id."""
    kind = draw(st.integers(0, 9))
    if kind < 6:
        keys = draw(st.lists(st.sampled_from(sorted(jobs_fields)), max_size=6, unique=True))
        body: dict[Any, Any] = {k: draw(jobs_fields[k]) for k in keys}
        if draw(st.integers(0, 5)) == 0:
            body[draw(st.text(max_size=6) | st.sampled_from(EDGE_STRINGS).map(Raw))] = draw(junk)
        raw = to_json(body if draw(st.integers(0, 9)) else draw(junk)).encode(
            "utf-8", "surrogatepass"
        )
        method = "POST" if draw(st.integers(0, 9)) else draw(st.sampled_from(METHODS))
        path = draw(st.sampled_from(["/v1/jobs", "/v1/jobs/", "/v1/jobs//", "/local/v1/jobs"]))
        return Request(method, path, draw(extra_headers()), draw(_mangle(raw)))
    job_id = draw(
        segments
        | st.sampled_from(["00000000-0000-0000-0000-000000000000", "x" * 64, "x" * 65])
        | st.text(max_size=70).map(_encode_segment)
    )
    path = draw(st.sampled_from(["/v1/jobs/{}", "/v1/jobs/{}/", "/v1/jobs/{}/x", "/v1/{}"]))
    method = "GET" if draw(st.integers(0, 4)) else draw(st.sampled_from(METHODS))
    return Request(method, path.format(job_id), draw(extra_headers()))


# --- the client and the contract --------------------------------------------------------


@dataclass
class Answer:
    """A response as read off the wire."""

    status: int
    headers: dict[str, str]
    body: bytes


class Client:
    """One keep-alive HTTP/1.1 connection, reopened when the server closes it."""

    def __init__(self, base: str) -> None:
        host, _, port = base.removeprefix("http://").partition(":")
        self.host, self.port = host, int(port)
        self.conn: http.client.HTTPConnection | None = None
        self.reconnects = 0

    def send(self, request: Request) -> Answer:
        """Send one request and read the whole answer (a timeout is a hang: it raises)."""
        for attempt in (0, 1):
            conn = self._connection()
            try:
                # Header values go out as UTF-8 bytes, as a careless client would send them.
                sent = {k: v.encode() for k, v in request.headers.items()}
                conn.request(request.method, request.path, request.body, sent)
                response = conn.getresponse()
                body = response.read()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                # A server may close an idle keep-alive connection; retry once on a fresh one.
                self.close()
                if attempt:
                    raise
                continue
            except TimeoutError as exc:
                self.close()
                raise AssertionError(f"no answer within {TIMEOUT_S} s: {request!r}") from exc
            headers = {k.lower(): v for k, v in response.getheaders()}
            if response.will_close:
                self.close()
            return Answer(response.status, headers, body)
        raise AssertionError("unreachable")

    def _connection(self) -> http.client.HTTPConnection:
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=TIMEOUT_S)
            self.reconnects += 1
        return self.conn

    def close(self) -> None:
        """Close the connection (the next request opens a new one)."""
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def check_answer(request: Request, answer: Answer) -> None:
    """The contract: 2xx or 4xx; a 4xx is ``{"error": str, "code": str}``; a 2xx body is
    JSON, or a binary infer answer whose JSON header has the length it declares."""
    where = f"{answer.status} {answer.body[:300]!r} for {request!r}"
    assert 200 <= answer.status < 300 or 400 <= answer.status < 500, where
    if answer.status >= 400:
        document = json.loads(answer.body)
        assert isinstance(document, dict), where
        assert isinstance(document.get("error"), str), where
        assert isinstance(document.get("code"), str), where
        assert document["code"], where
        return
    content_type = answer.headers.get("content-type", "")
    if content_type == "application/octet-stream":
        length = int(answer.headers["inference-header-content-length"])
        assert 0 <= length <= len(answer.body), where
        assert isinstance(json.loads(answer.body[:length]), dict), where
    elif content_type.startswith("application/json") and answer.body:
        json.loads(answer.body)
    elif answer.body:
        assert content_type.startswith("text/plain"), where  # /metrics


# --- slow clients -----------------------------------------------------------------------


class Attack:
    """Raw connections that hold a server: each sends its opening bytes, then stalls."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.socks: list[socket.socket] = []
        self.drippers: list[socket.socket] = []

    def _open(self, receive_buffer: int | None = None) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if receive_buffer is not None:  # a small window: the server's writes back up soon
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        sock.settimeout(TIMEOUT_S)
        sock.connect(("127.0.0.1", self.port))
        self.socks.append(sock)
        return sock

    def slow_heads(self, count: int) -> None:
        """Request heads begun and then dripped a byte at a time (slowloris)."""
        for _ in range(count):
            self._open().sendall(b"POST /v2/models/digits/infer HTTP/1.1\r\nHo")
            self.drippers.append(self.socks[-1])

    def stalled_bodies(self, count: int, path: str) -> None:
        """A 1 MiB body announced, 1 KiB of it sent."""
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {1 << 20}\r\n\r\n"
        for _ in range(count):
            self._open().sendall(head.encode() + b" " * 1024)

    def silent_continues(self, count: int, path: str) -> None:
        """``Expect: 100-continue``, the 100 read, and no body."""
        head = (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 4096\r\n"
            "Expect: 100-continue\r\n\r\n"
        ).encode()
        for _ in range(count):
            sock = self._open()
            sock.sendall(head)
            assert sock.recv(64).startswith(b"HTTP/1.1 100 "), "no 100 Continue"

    def never_reading(self, count: int, request: bytes, depth: int) -> None:
        """``depth`` pipelined requests per connection (as much of them as the server
        takes without waiting), answers never read."""
        for _ in range(count):
            sock = self._open(receive_buffer=4096)
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):  # the server stopped reading
                sock.sendall(request * depth)

    def wait_closed(self, within_s: float) -> list[float]:
        """Seconds until the server closed each connection (a FIN or a reset, read or
        not), dripping a byte to the slow heads every half second meanwhile."""
        started = time.monotonic()
        poller = select.poll()
        hang_up = select.POLLRDHUP | select.POLLHUP | select.POLLERR
        open_ = {sock.fileno(): sock for sock in self.socks}
        for fd in open_:
            poller.register(fd, hang_up)
        closed: list[float] = []
        while open_:
            left = started + within_s - time.monotonic()
            assert left > 0, f"{len(open_)} of {len(self.socks)} connections still open"
            for fd, _ in poller.poll(min(left, 0.5) * 1000):
                poller.unregister(fd)
                open_.pop(fd)
                closed.append(time.monotonic() - started)
            for sock in self.drippers:
                if sock.fileno() in open_:
                    with contextlib.suppress(OSError):  # closed since the poll
                        sock.send(b"s")
        return closed

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


class Steady(threading.Thread):
    """A well-behaved client sending ``request`` on one keep-alive connection until
    stopped; the statuses it got, in order."""

    def __init__(self, base: str, request: Request) -> None:
        super().__init__(daemon=True)
        self.client = Client(base)
        self.request = request
        self.statuses: list[int] = []
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.statuses.append(self.client.send(self.request).status)
        except (AssertionError, OSError, http.client.HTTPException) as exc:
            self.error = exc  # the test reads it: a hang or a dropped connection
        finally:
            self.client.close()

    def __enter__(self) -> Steady:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.join(TIMEOUT_S)
