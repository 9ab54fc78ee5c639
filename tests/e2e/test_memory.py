"""Memory bounds under a flood of big bodies: the GPU service's in-flight byte budget keeps
its resident memory (parse processes included) bounded and every request gets an answer;
the batch runner skips an oversized JSON Lines record without holding it."""

from __future__ import annotations

import http.client
import json
import os
import select
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spillway.aws.clients import aws_client
from spillway.protocol.codec import decode_response, encode_request
from spillway_cli.jobs_cli import LAUNCHER
from tests.integration.test_jobs_support import (
    digits_images,
    get_lines,
    jobs_settings,
    new_bucket,
    record,
)
from tests.support import Service, gpu_service, link_model, load_engine

MIB = 1 << 20
MAX_BODY = 32 * MIB  # GPU_MAX_BODY_BYTES (the default, spelled out)
IN_FLIGHT = 128 * MIB  # GPU_MAX_BODY_BYTES_IN_FLIGHT (the default): four full bodies
PARSE_PROCESSES = 2  # GPU_PARSE_PROCESSES (the default)
BODY = 30 * MIB  # each big body: just under the cap
CLIENTS = 40  # 10x the four full bodies the budget admits at once
REQUESTS_PER_CLIENT = 3
ANSWER_TIMEOUT_S = 30.0  # a request without an answer by then counts as a hang

# The bound on the service's resident memory (its parse processes included) above the
# warmed-up baseline, from the settings. The parent holds at most IN_FLIGHT bytes of
# bodies, each up to three times at once (the chunks read, their join, the copy pickled to
# a parse process): 3 x IN_FLIGHT. A parse process holds one body at a time, and parsing
# JSON numbers costs ~8 bytes of Python objects per byte of text (a float object and a
# list slot for every four bytes like "1.5,"), plus the body, its text and the tensor:
# 12 x MAX_BODY each. Freed memory is not always handed back to the OS, so peaks stay
# resident. 384 + 768 = 1152 MiB; measured on a 2-core machine: ~800-860 MiB (parent
# ~+230, each parse process ~+330). Without the budget 40 clients' bodies alone would be
# 2.4 GiB in the parent, and the flood does not finish within ANSWER_TIMEOUT_S.
RSS_BOUND = 3 * IN_FLIGHT + PARSE_PROCESSES * 12 * MAX_BODY

# The batch runner reads a JSON Lines record at most JOBS_MAX_RECORD_BYTES (1 MiB) at a
# time: a 60 MB line must not raise its peak by more than a few MiB over a run without it
# (the download streams to disk in 1 MiB chunks). Parsing that line would take ~1 GB.
BIG_LINE = 60_000_000
RUNNER_BOUND = 32 * MIB


# --- measuring ----------------------------------------------------------------------


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0  # a zombie has no resident memory


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def tree_rss(pid: int) -> tuple[int, int]:
    """Resident bytes of a process and all its descendants, and how many there are."""
    total, count, pending = 0, 0, [pid]
    while pending:
        current = pending.pop()
        try:
            total += _rss(current)
            pending += _children(current)
            count += 1
        except (FileNotFoundError, ProcessLookupError):
            continue  # it exited between the listing and the read
    return total, count


@contextmanager
def peak_rss(pid: int, interval_s: float = 0.02) -> Iterator[list[int]]:
    """Samples the tree's resident memory until the block ends; yields the samples."""
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(tree_rss(pid)[0])
            stop.wait(interval_s)  # the sampling period, not a wait for a condition

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()
        samples.append(tree_rss(pid)[0])


# --- a raw HTTP client that can read an early answer and hang up mid-body ---------------


@dataclass(frozen=True)
class Body:
    """One request body and how it is sent."""

    kind: str
    data: bytes
    content_type: str
    header_length: int | None = None
    declared: int | None = None  # Content-Length when it differs from len(data)
    hang_up: bool = False  # close the connection after sending data (short of declared)


@dataclass(frozen=True)
class Answer:
    kind: str
    status: int | None  # None: no answer (a hang-up before one arrived)
    retry_after: str | None
    body: bytes
    header_length: str | None


def send(port: int, body: Body) -> Answer:
    """POST ``body``; stop sending as soon as an answer arrives (a refusal before the body
    is read), so that answer is read rather than lost to a reset."""
    deadline = time.monotonic() + ANSWER_TIMEOUT_S
    length = len(body.data) if body.declared is None else body.declared
    head = (
        "POST /v2/models/digits/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: {body.content_type}\r\nContent-Length: {length}\r\n"
    )
    if body.header_length is not None:
        head += f"Inference-Header-Content-Length: {body.header_length}\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=ANSWER_TIMEOUT_S) as sock:
        sock.sendall(f"{head}\r\n".encode())
        view, sent, answered = memoryview(body.data), 0, False
        while sent < len(view) and not answered:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{body.kind}: stuck after {sent} bytes")
            readable, writable, _ = select.select([sock], [sock], [], remaining)
            answered = bool(readable)
            if writable and not answered:
                try:
                    sent += sock.send(view[sent : sent + MIB])
                except (BrokenPipeError, ConnectionResetError):
                    answered = True  # closed by the server: its answer, if any, is queued
        if body.hang_up and not answered:
            return Answer(body.kind, None, None, b"", None)
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        response = http.client.HTTPResponse(sock, method="POST")
        response.begin()
        return Answer(
            body.kind,
            response.status,
            response.getheader("retry-after"),
            response.read(),
            response.getheader("inference-header-content-length"),
        )


# --- the bodies -------------------------------------------------------------------------


def _padded_json(request: bytes, size: int) -> bytes:
    """A JSON document grown to ``size`` bytes with whitespace (still the same request)."""
    return request[:-1] + b" " * (size - len(request)) + b"}"


def big_bodies(images: np.ndarray) -> list[Body]:
    """Valid JSON and binary requests of 30 MiB (whitespace in their JSON), a binary one
    whose 30 MiB tensor exceeds the batch limit, malformed JSON of 30 MiB of numbers, one
    that announces 32 MiB and hangs up a byte short, and one that announces too much."""
    valid_json, _ = encode_request({"image": images[:64]}, binary=False)
    binary, header_length = encode_request({"image": images[:64]}, binary=True)
    assert header_length is not None
    header = _padded_json(binary[:header_length], BODY)
    rows = BODY // (64 * 4)
    huge, huge_header = encode_request({"image": np.ones((rows, 8, 8), np.float32)}, binary=True)
    row = b"[" + b",".join([b"12.5"] * 8) + b"]"
    numbers = b'{"inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 8, 8], "data": ['
    numbers += b",".join([row] * (BODY // (len(row) + 1)))  # never closed: malformed
    return [
        Body("valid-json", _padded_json(valid_json, BODY), "application/json"),
        Body(
            "valid-binary",
            header + binary[header_length:],
            "application/octet-stream",
            header_length=len(header),
        ),
        Body("batch-too-big", huge, "application/octet-stream", header_length=huge_header),
        Body("malformed", numbers, "application/json"),
        Body("hang-up", b"{" * (MAX_BODY - 1), "application/json", MAX_BODY, hang_up=True),
        Body("too-large", b"{}", "application/json", declared=MAX_BODY + 1),
    ]


ALLOWED: dict[str, set[int | None]] = {
    "valid-json": {200, 429, 503},
    "valid-binary": {200, 429, 503},
    "batch-too-big": {400, 503},
    "malformed": {400, 503},
    "hang-up": {None, 503},
    "too-large": {413},
}


@pytest.fixture(scope="module")
def service(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("memory")
    link_model(models_dir, tmp / "repo", "digits")
    settings: dict[str, Any] = {
        "max_body_bytes": str(MAX_BODY),
        "max_body_bytes_in_flight": str(IN_FLIGHT),
        "parse_processes": str(PARSE_PROCESSES),
    }
    with gpu_service(tmp / "repo", tmp / "logs", **settings) as svc:
        yield svc


def test_a_flood_of_big_bodies_is_answered_within_the_memory_bound(
    service: Service, models_dir: Path
) -> None:
    # GIVEN the service warmed up: each kind of body once, then big JSON bodies in parallel
    # until every parse process has started (they start on demand)
    images = digits_images(models_dir)
    bodies = big_bodies(images)
    for body in bodies:
        assert send(service.port, body).status in ALLOWED[body.kind] - {503}
    malformed = [b for b in bodies if b.kind == "malformed"] * PARSE_PROCESSES
    # the service, its parse processes and multiprocessing's resource tracker
    for _ in range(5):
        if tree_rss(service.child.pid)[1] >= 2 + PARSE_PROCESSES:
            break
        with ThreadPoolExecutor(PARSE_PROCESSES) as pool:
            assert {a.status for a in pool.map(lambda b: send(service.port, b), malformed)} == {400}
    baseline, processes = tree_rss(service.child.pid)
    assert processes == 2 + PARSE_PROCESSES, "the parse processes did not all start"

    # WHEN 40 clients each send three 30 MiB bodies at once (10x what the budget admits)
    def client(index: int) -> list[Answer]:
        picks = [bodies[(index * REQUESTS_PER_CLIENT + j) % len(bodies)] for j in range(3)]
        return [send(service.port, body) for body in picks]

    started = time.monotonic()
    with peak_rss(service.child.pid) as samples, ThreadPoolExecutor(CLIENTS) as pool:
        answers = [a for batch in pool.map(client, range(CLIENTS)) for a in batch]
    seconds = time.monotonic() - started
    peak = max(samples)

    # THEN every request was answered (none hung) with a status its kind allows
    assert len(answers) == CLIENTS * REQUESTS_PER_CLIENT
    by_kind = Counter((a.kind, a.status) for a in answers)
    assert [k for k in by_kind if k[1] not in ALLOWED[k[0]]] == [], by_kind
    # AND the budget refused some with 503 and a retry hint, and still served some
    refused = [a for a in answers if a.status == 503]
    assert refused, by_kind
    assert all(a.retry_after is not None and int(a.retry_after) >= 1 for a in refused)
    assert by_kind[("valid-json", 200)] + by_kind[("valid-binary", 200)] > 0, by_kind
    # AND the service's memory (parse processes included) stayed under the bound
    report = {
        "baseline_mib": round(baseline / MIB),
        "peak_mib": round(peak / MIB),
        "growth_mib": round((peak - baseline) / MIB),
        "bound_mib": round(RSS_BOUND / MIB),
        "seconds": round(seconds, 1),
        "answers": {f"{k}:{s}": n for (k, s), n in sorted(by_kind.items(), key=str)},
    }
    print(json.dumps(report))
    assert peak - baseline < RSS_BOUND, report

    # AND afterwards a valid request is served, correctly
    assert service.child.proc.poll() is None
    small, length = encode_request({"image": images[:8]}, binary=True)
    answer = send(
        service.port, Body("after", small, "application/octet-stream", header_length=length)
    )
    assert answer.status == 200, answer
    header_length = None if answer.header_length is None else int(answer.header_length)
    _, outputs = decode_response(answer.body, header_length)
    expected = load_engine(models_dir, "digits").infer({"image": images[:8]})
    np.testing.assert_array_equal(outputs["label"], expected["label"])


def _run_jobs(argv: list[str], env: dict[str, str], log: Path) -> tuple[int, int]:
    """Run a ``spillway jobs`` child to its end: exit code and peak resident bytes."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}
        )
    try:
        # wait4 reports the child's own peak; Popen.wait would discard it.
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss * 1024


def test_runner_skips_a_60_mb_record_without_holding_it(
    aws_env: str, models_dir: Path, tmp_path: Path
) -> None:
    # GIVEN a JSON Lines shard of digits records with one valid-JSON 60 MB line among them,
    # and the same shard without it
    jobs_settings(aws_env, models_dir)  # the moto resources the runner expects
    images = digits_images(models_dir)
    lines = [record(f"r{i}", image=images[i].tolist()) for i in range(20)]
    filler = "0.0," * (BIG_LINE // 4)
    big = '{"id": "big", "data": {"image": [' + filler + "0.0]}}"
    assert len(big) >= BIG_LINE
    bucket = new_bucket()
    s3 = aws_client("s3")
    s3.put_object(Bucket=bucket, Key="small/a.jsonl", Body="\n".join(lines) + "\n")
    with_big = [*lines[:10], big, *lines[10:]]
    s3.put_object(Bucket=bucket, Key="big/a.jsonl", Body="\n".join(with_big) + "\n")

    # WHEN the runner runs over each in its own process
    def run(prefix: str) -> tuple[int, int]:
        argv = [*LAUNCHER, "run", "--repository", str(models_dir), "--model", "digits"]
        argv += ["--input", f"s3://{bucket}/{prefix}/", "--output", f"s3://{bucket}/out-{prefix}/"]
        env = {
            "JOBS_WORK_DIR": str(tmp_path / prefix),
            "JOBS_PROVIDERS": '["CPUExecutionProvider"]',
        }
        return _run_jobs(argv, env, tmp_path / f"{prefix}.log")

    small_rc, small_peak = run("small")
    big_rc, big_peak = run("big")

    # THEN both commit; the big line is a payload_too_large error, the rest are outputs
    assert (small_rc, big_rc) == (0, 0), (tmp_path / "big.log").read_text()[-2000:]
    outputs = get_lines(bucket, "out-big/part-00000.jsonl")
    assert [o["id"] for o in outputs] == [f"r{i}" for i in range(20)]
    errors = get_lines(bucket, "out-big/part-00000.errors.jsonl")
    assert [(e["id"], e["code"], e["line"]) for e in errors] == [(None, "payload_too_large", 11)]
    # AND the runner's peak memory hardly moved with a 60 MB line in its input
    report = {
        "runner_peak_mib_without": round(small_peak / MIB),
        "runner_peak_mib_with_60mb_line": round(big_peak / MIB),
        "bound_mib": round((small_peak + RUNNER_BOUND) / MIB),
    }
    print(json.dumps(report))
    assert big_peak < small_peak + RUNNER_BOUND, report
