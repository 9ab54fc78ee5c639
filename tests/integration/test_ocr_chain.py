"""The ``ocr`` pipeline in its Step Functions form: one state per step, mapped steps too.

GIVEN the OCR models and the ``ocr`` pipeline, the state machine definition its
configuration makes, run by the local interpreter with every state a ``ChainEvent`` to
the CPU fallback's chain handler and the request's tensors in S3 (moto)
WHEN a rendered page, a blank page and a text file go through it
THEN the page's response is the CPU fallback's direct ``ocr`` answer (the same text, the
same boxes), the blank page's has no lines (its mapped steps got no rows), and the text
file stops at the first step as a ``ClientFault`` with ``invalid_image`` in its record.
"""

from __future__ import annotations

import io
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from spillway.aws.clients import aws_client
from spillway.fallback.chain import handle_chain_event
from spillway.fallback.service import CpuService
from spillway.fallback.settings import CpuSettings
from spillway.models.processing import Tensors
from spillway.models.repository import LocalRepository
from spillway.pipelines.chain import ChainStore
from spillway.pipelines.graph import read_pipeline
from spillway.protocol.codec import decode_response, encode_request
from spillway.protocol.errors import SpillwayError
from spillway.protocol.messages import read_staged_request, stage_request
from spillway.protocol.s3urls import parse_s3_url
from spillway.protocol.wire import ANONYMOUS_SCOPE
from spillway_cli.local.states import Execution, LocalStateMachine, substituted
from spillway_cli.modelbuild.build import build_repository
from spillway_cli.modelbuild.ocr import render_lines
from spillway_cli.statemachines import chain_definition, substitutions
from tests.integration.test_ocr_bounds import bomb
from tests.support import link_model

OCR = ["ocr-det", "ocr-cls", "ocr-rec", "ocr-lines", "ocr"]
FUNCTION = "arn:aws:lambda:us-east-1:123456789012:function:spillway-cpu-infer:live"
PAGE = ["the old elephant walked slowly", "to the river with her calf", "click here to claim"]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Path:
    """The OCR models linked from the session's repository (built here where it has none)."""
    root = tmp_path_factory.mktemp("ocr-chain")
    missing = [name for name in OCR if not (models_dir / name).is_dir()]
    for name in OCR:
        if name not in missing:
            link_model(models_dir, root, name)
    if missing:
        build_repository(root, missing)
    return root


@pytest.fixture(scope="module")
def cpu(repo: Path) -> CpuService:
    return CpuService.load(
        CpuSettings(repository=str(repo), models=["ocr-det", "ocr-cls", "ocr-rec", "ocr"])
    )


@dataclass
class Chain:
    """The ``ocr`` state machine over the CPU fallback's chain handler and a bucket."""

    machine: LocalStateMachine
    bucket: str
    calls: list[tuple[str, int | None]] = field(default_factory=list)

    def run(self, image: bytes) -> tuple[str, Execution]:
        rid = uuid.uuid4().hex
        body, length = request(image)
        aws_client("s3").put_object(
            Bucket=self.bucket, Key=f"async/{rid}/request.v2req", Body=stage_request(body, length)
        )
        return rid, self.machine.run({"id": rid, "tenant_scope": ANONYMOUS_SCOPE})

    def result(self, rid: str) -> Tensors:
        staged = self._get(f"async/{rid}/result")
        header, outputs = decode_response(*read_staged_request(staged))
        assert (header.model_name, header.model_version) == ("ocr", "1")
        return outputs

    def error(self, rid: str) -> dict[str, Any]:
        record: dict[str, Any] = json.loads(self._get(f"async/{rid}/error.json"))
        return record

    def _get(self, key: str) -> bytes:
        body: bytes = aws_client("s3").get_object(Bucket=self.bucket, Key=key)["Body"].read()
        return body


@pytest.fixture
def chain(aws_env: str, cpu: CpuService, repo: Path) -> Chain:
    bucket = f"spillway-ocr-chain-{uuid.uuid4().hex[:8]}"
    s3 = aws_client("s3")
    s3.create_bucket(Bucket=bucket)
    store = ChainStore(parse_s3_url(f"s3://{bucket}/async"), s3)
    repository = LocalRepository(repo)
    definition = chain_definition(read_pipeline(repository, repository.read_config("ocr")))
    local = substituted(definition, substitutions(FUNCTION, bucket))
    calls: list[tuple[str, int | None]] = []

    def cpu_function(event: dict[str, Any]) -> dict[str, Any]:
        calls.append((event["spillway"], event.get("step")))
        return handle_chain_event(cpu, event, store)

    functions: dict[str, Callable[[dict[str, Any]], Any]] = {FUNCTION: cpu_function}
    machine = LocalStateMachine(local, functions=functions, s3=s3, sleep=lambda _: None)
    return Chain(machine, bucket, calls)


def request(image: bytes) -> tuple[bytes, int | None]:
    return encode_request(
        {"image": np.array([image], dtype=np.object_)}, binary=True, binary_outputs=True
    )


def direct(cpu: CpuService, image: bytes) -> Tensors:
    """The CPU fallback's own ``ocr`` answer."""
    encoded = cpu.infer("ocr", None, *request(image))
    return decode_response(encoded.body, encoded.header_length)[1]


def texts(column: np.ndarray) -> list[str]:
    return [t.decode() for t in column.reshape(-1)]


def blank_page() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (720, 720), "white").save(buffer, format="PNG")
    return buffer.getvalue()


def assert_same_answer(chained: Tensors, expected: Tensors) -> None:
    assert set(chained) == set(expected)
    assert texts(chained["text"]) == texts(expected["text"])
    assert chained["counts"].tolist() == expected["counts"].tolist()
    assert chained["boxes"].shape == expected["boxes"].shape
    np.testing.assert_allclose(chained["boxes"], expected["boxes"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(chained["scores"], expected["scores"], atol=1e-4, rtol=0)


def test_a_page_through_the_state_machine_is_the_direct_answer(
    chain: Chain, cpu: CpuService
) -> None:
    # GIVEN a page of three lines
    page = render_lines(PAGE, size=24, min_side=720)
    # WHEN it runs one step per state
    rid, execution = chain.run(page)
    # THEN every step ran once, then Respond, and the answer is the direct one
    assert execution.status == "SUCCEEDED", execution
    steps = [("pipeline-step", k) for k in range(len(OCR) - 1)]
    assert chain.calls == [*steps, ("pipeline-respond", None)]
    chained, expected = chain.result(rid), direct(cpu, page)
    assert chained["counts"].tolist() == [len(PAGE)]
    assert texts(chained["text"]) == PAGE
    assert_same_answer(chained, expected)


def test_a_blank_page_has_no_lines_and_its_mapped_steps_no_rows(
    chain: Chain, cpu: CpuService
) -> None:
    # GIVEN a white page
    page = blank_page()
    # WHEN it runs through the state machine
    rid, execution = chain.run(page)
    # THEN it succeeds with no lines, as the direct answer has none
    assert execution.status == "SUCCEEDED", execution
    chained = chain.result(rid)
    assert chained["counts"].tolist() == [0]
    assert chained["text"].shape == (0, 1)
    assert chained["boxes"].shape == (0, 4, 2)
    assert_same_answer(chained, direct(cpu, page))


def test_a_bad_image_fails_the_first_step_as_a_client_fault(chain: Chain, cpu: CpuService) -> None:
    # GIVEN a text file where the image goes (directly: a 400 invalid_image)
    data = b"hello, this is not an image\n"
    with pytest.raises(SpillwayError) as raised:
        direct(cpu, data)
    assert (raised.value.status, raised.value.code) == (400, "invalid_image")
    # WHEN it runs through the state machine
    rid, execution = chain.run(data)
    # THEN the first step fails once, never retried, and the record holds its reason
    assert execution.status == "FAILED"
    assert chain.calls.count(("pipeline-step", 0)) == 1
    assert ("pipeline-step", 1) not in chain.calls
    record = chain.error(rid)
    assert record["Error"] == "ClientFault"
    reason = json.loads(json.loads(record["Cause"])["errorMessage"])
    assert (reason["status"], reason["code"]) == (400, "invalid_image")


def test_the_bomb_stops_at_the_first_mapped_step_as_a_client_fault(chain: Chain) -> None:
    # GIVEN a page of 600 tiny words: detection cuts 600 crops, the pipeline allows 256
    # WHEN it runs through the state machine
    rid, execution = chain.run(bomb())
    # THEN detection ran, the orientation step refused it once (never retried) before a
    # crop was read, recognition never ran, the failure was settled, and the record holds
    # the refusal
    assert execution.status == "FAILED"
    steps = [("pipeline-step", 0), ("pipeline-step", 1)]
    assert chain.calls == [*steps, ("pipeline-failed", None)]
    record = chain.error(rid)
    assert record["Error"] == "ClientFault"
    reason = json.loads(json.loads(record["Cause"])["errorMessage"])
    assert (reason["status"], reason["code"]) == (413, "fanout_too_large")
    assert "would run 600 rows for this request; it allows at most 256" in reason["error"]
