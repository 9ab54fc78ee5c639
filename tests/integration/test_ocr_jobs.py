"""Bulk OCR: a batch job over an S3 prefix of images, on the moto server, for two tenants.

GIVEN the OCR models built into a fresh repository, and in each of two tenants' areas a
few rendered pages (PNG and JPEG) beside a truncated JPEG, a text file named ``.png`` and a
file that is no image at all (ignored: not an input suffix)
WHEN each tenant submits an ``ocr`` job over its own ``in/`` through the jobs API and the
job runs
THEN every page is one output line (its key, its lines of text, their boxes), each bad
image one line of the errors file with its key and stable code, and a tenant's job never
reads or writes outside its own area.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from PIL import Image

from batch_job.plan import RunSpec
from batch_job.runner import run_job
from batch_job.settings import JobsSettings
from spillway.aws.clients import aws_client
from spillway_cli.modelbuild.build import build_repository
from spillway_cli.modelbuild.ocr import render_lines
from tests.integration.test_jobs_support import get_lines
from tests.integration.test_jobs_tenancy import Deployment, _call, tenant_deployment
from tests.integration.test_ocr_pipelines import SENTENCES

PAGES = {
    "tenant-a": [SENTENCES[0:2], SENTENCES[2:4]],
    "tenant-b": [SENTENCES[0:1]],
}


def _jpeg(png: bytes) -> bytes:
    buffer = io.BytesIO()
    Image.open(io.BytesIO(png)).convert("RGB").save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


@pytest.fixture
def deployment(
    aws_env: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Deployment, JobsSettings]:
    repo = tmp_path / "repo"
    build_repository(repo, ["ocr-det", "ocr-cls", "ocr-rec", "ocr-lines", "ocr"])
    found, settings = tenant_deployment(aws_env, repo, monkeypatch)
    s3 = aws_client("s3")
    for tenant, pages in PAGES.items():
        prefix = found.area(tenant).split("/", 3)[3] + "in/"
        for number, lines in enumerate(pages):
            png = render_lines(lines, size=24, min_side=720)
            name, body = (f"page-{number}.jpg", _jpeg(png)) if number else ("page-0.png", png)
            s3.put_object(Bucket=found.data, Key=f"{prefix}{name}", Body=body)
        bad = {
            "scan-truncated.jpg": b"\xff\xd8\xff\xe0" + b"\x00" * 64,
            "notes.png": b"hello, this is not an image\n",
            "readme.txt": b"not an input: no image suffix\n",
        }
        for name, body in bad.items():
            s3.put_object(Bucket=found.data, Key=f"{prefix}{name}", Body=body)
    return found, settings


def test_a_job_ocrs_each_tenants_images(deployment: tuple[Deployment, JobsSettings]) -> None:
    found, settings = deployment
    for who, tenant in (("a", "tenant-a"), ("b", "tenant-b")):
        area = found.area(tenant)
        prefix = area.split("/", 3)[3]
        # WHEN the tenant submits an ocr job over its images and the job runs
        status, receipt = _call(
            who,
            "POST",
            "/v1/jobs",
            {"model": "ocr", "input": f"{area}in/", "output": f"{area}out/"},
        )
        assert status == 202, receipt
        job = receipt["job"]
        assert job["shards_total"] == 1  # every image of the prefix in one images shard
        result = run_job(RunSpec("ocr", job["input"], job["output"]), settings)
        assert (result.committed, result.failed) == (["part-00000"], {})
        out = job["output"].split("/", 3)[3]
        # THEN one output line per page: its key, its lines, their boxes
        outputs = {o["id"]: o["outputs"] for o in get_lines(found.data, f"{out}part-00000.jsonl")}
        pages = PAGES[tenant]
        keys = [f"{prefix}in/page-{n}.{'jpg' if n else 'png'}" for n in range(len(pages))]
        assert sorted(outputs) == sorted(keys)
        for key, lines in zip(keys, pages, strict=True):
            assert [row[0] for row in outputs[key]["text"]] == lines, key
            assert outputs[key]["counts"] == [len(lines)]
            assert [len(box) for box in outputs[key]["boxes"]] == [4] * len(lines)
        # AND each bad image one error line with its key and code; the text file is no input
        errors = get_lines(found.data, f"{out}part-00000.errors.jsonl")
        assert {e["id"]: e["code"] for e in errors} == {
            f"{prefix}in/scan-truncated.jpg": "invalid_image",
            f"{prefix}in/notes.png": "invalid_image",
        }
        # AND the job wrote into the tenant's own area
        assert job["output"].startswith(f"{area}out/")
    # AND one tenant may not run a job over the other's images
    a = found.area("tenant-a")
    status, answer = _call(
        "b", "POST", "/v1/jobs", {"model": "ocr", "input": f"{a}in/", "output": f"{a}out/"}
    )
    assert (status, answer["code"]) == (403, "outside_tenant_area")
