"""Batch-job throughput against raw ONNX Runtime on the same data, in one run.

For ``mlp-bench`` (``.npy`` shards) and ``minilm`` (JSON Lines text shards) it times the
job runner over the shards (download, parse, prepare, batched runs, outputs, atomic
commit; model load excluded) with the inputs in a local folder and on S3 (a moto server
in its own process on 127.0.0.1, sharing the CPU), and the same ONNX Runtime session
running the same batches directly from prepared feeds (no parsing, tokenising or I/O).
Each attempt runs both jobs then raw; after a warm-up attempt, the table gives the best
wall-clock rate of ``--repeats`` attempts for each (on a shared machine noise only ever
slows a run down) with the ratio of the bests, and the median per-attempt ratio of records
per CPU-second of this process. Prints a markdown table.

    .venv/bin/python -m bench.jobs_bench [--quick] [--providers CUDAExecutionProvider]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from batch_job.plan import Locations, Plan, RunSpec, ensure_plan
from batch_job.runner import JobRunner, load_model
from batch_job.settings import JobsSettings
from batch_job.shard import JobModel
from spillway.aws.clients import aws_client
from spillway.models.repository import open_repository
from spillway_cli.local import procs

ROOT = Path(__file__).resolve().parent.parent
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "rain",
    "falls",
    "on",
    "quiet",
    "hills",
]


Rate = tuple[float, float]
"""Records per second of wall-clock time, and per second of this process's CPU time."""


@dataclass
class Row:
    """One line of the results table."""

    model: str
    input: str
    records: int
    batch: int
    raw: list[Rate]
    folder: list[Rate]
    s3: list[Rate]

    def markdown(self) -> str:
        """Wall clock: best of the attempts (noise only ever slows a run). CPU time: the
        median per-attempt ratio of records per CPU-second, which other tenants of a shared
        machine hardly move (moto's CPU, in its own process, is not counted)."""
        raw = max(wall for wall, _ in self.raw)
        cells = [self.model, self.input, str(self.records), str(self.batch), f"{raw:,.0f}"]
        for rates in (self.folder, self.s3):
            best = max(wall for wall, _ in rates)
            cpu = statistics.median(j[1] / r[1] for j, r in zip(rates, self.raw, strict=True))
            cells += [f"{best:,.0f}", f"{best / raw:.3f}", f"{cpu:.3f}"]
        return "| " + " | ".join(cells) + " |"


HEADER = (
    "| model | input | records | batch | raw ORT rec/s | job, folder rec/s | ratio | CPU ratio "
    "| job, S3 (moto) rec/s | ratio | CPU ratio |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def mlp_files(rows: int, shards: int) -> dict[str, bytes]:
    """``shards`` ``.npy`` files of random ``[n, 1024]`` float32 rows."""
    rng = np.random.default_rng(0)
    files = {}
    for s in range(shards):
        buffer = io.BytesIO()
        np.save(buffer, rng.standard_normal((rows // shards, 1024), dtype=np.float32))
        files[f"{s:03d}.npy"] = buffer.getvalue()
    return files


def text_files(records: int, shards: int) -> dict[str, bytes]:
    """``shards`` JSON Lines files of sentences of 5 to 40 words."""
    rng = np.random.default_rng(1)
    files = {}
    for s in range(shards):
        lines = []
        for i in range(records // shards):
            text = " ".join(rng.choice(WORDS, int(rng.integers(5, 41))))
            lines.append(json.dumps({"id": f"{s}-{i}", "data": {"text": text}}))
        files[f"{s:03d}.jsonl"] = ("\n".join(lines) + "\n").encode()
    return files


def raw_feeds(model: Any, files: dict[str, bytes], batch: int) -> list[dict[str, np.ndarray]]:
    """The graph feeds of every batch the job runs, prepared ahead (untimed)."""
    feeds = []
    for name, body in files.items():
        if name.endswith(".npy"):
            array = np.load(io.BytesIO(body), allow_pickle=False)
            for first in range(0, len(array), batch):
                prepared = [model.prepare({"input": array[first : first + batch]})]
                feeds.append(model.processor.collate(prepared))
            continue
        texts = [json.loads(line)["data"]["text"] for line in body.decode().splitlines()]
        for first in range(0, len(texts), batch):
            chunk = texts[first : first + batch]
            prepared = [model.prepare({"text": np.array([[t.encode()]], object)}) for t in chunk]
            feeds.append(model.processor.collate(prepared))
    return feeds


def time_raw(model: Any, feeds: list[dict[str, np.ndarray]], records: int) -> Rate:
    """Records/s of the session running every batch."""
    names = [o.name for o in model.session.get_outputs()]
    started, cpu = time.perf_counter(), time.process_time()
    for feed in feeds:
        model.session.run(names, feed)
    return records / (time.perf_counter() - started), records / (time.process_time() - cpu)


def time_job(
    spec: RunSpec, settings: JobsSettings, plan: Plan, model: JobModel, where: Locations
) -> Rate:
    """Records/s of the job runner over every shard (a fresh output prefix each time)."""
    runner = JobRunner(spec, settings, plan, model, where)
    started, cpu = time.perf_counter(), time.process_time()
    result = runner.run(list(plan.shards))
    elapsed, cpu_s = time.perf_counter() - started, time.process_time() - cpu
    if result.failed or not result.committed:
        raise RuntimeError(f"job failed: {result.failed}")
    return result.records / elapsed, result.records / cpu_s


def bench_model(
    name: str,
    files: dict[str, bytes],
    settings: JobsSettings,
    bucket: str,
    work: Path,
    repeats: int,
) -> Row:
    """Job over a folder, job over S3 and raw ORT, alternating."""
    s3 = aws_client("s3")
    run_id = uuid.uuid4().hex[:8]
    (work / name / "in").mkdir(parents=True)
    for key, body in files.items():
        (work / name / "in" / key).write_bytes(body)
        s3.put_object(Bucket=bucket, Key=f"{name}-{run_id}/in/{key}", Body=body)
    repo = open_repository(settings.repository)
    sources = {  # input location, and the output location of attempt i
        "folder": (str(work / name / "in"), str(work / name / "out{}")),
        "s3": (f"s3://{bucket}/{name}-{run_id}/in/", f"s3://{bucket}/{name}-{run_id}/out{{}}/"),
    }
    model: Any = None
    rates: dict[str, list[Rate]] = {"raw": [], "folder": [], "s3": []}
    feeds: list[dict[str, np.ndarray]] = []
    records = 0
    for attempt in range(repeats + 1):  # attempt 0 warms every path up and is not counted
        job: dict[str, Rate] = {}
        for kind, (source, target) in sources.items():
            spec = RunSpec(name, source, target.format(attempt))
            where = Locations.of(spec)
            plan = ensure_plan(spec, repo, where)
            if model is None:
                model = load_model(repo, settings, plan)
                feeds = raw_feeds(model, files, model.config.max_batch_size)
                records = sum(int(f[next(iter(f))].shape[0]) for f in feeds)
            job[kind] = time_job(spec, settings, plan, model, where)
        raw = time_raw(model, feeds, records)
        if attempt:
            rates["raw"].append(raw)
            for kind, rate in job.items():
                rates[kind].append(rate)
    kind = "npy" if name == "mlp-bench" else "jsonl"
    batch = model.config.max_batch_size
    return Row(name, kind, records, batch, rates["raw"], rates["folder"], rates["s3"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Small data, 1 repeat.")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--repository", default=str(ROOT / "models"))
    parser.add_argument("--providers", nargs="+", default=["CPUExecutionProvider"])
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    mlp_rows, texts = (2048, 128) if args.quick else (8192, 512)
    with tempfile.TemporaryDirectory(prefix="jobs-bench-") as tmp:
        work = Path(tmp)
        port = procs.free_port()
        moto = procs.start(
            "moto", [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], work
        )
        try:
            procs.wait_http(f"http://127.0.0.1:{port}/moto-api/", 60, moto.proc)
            os.environ.update(
                AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
                AWS_ACCESS_KEY_ID="bench",
                AWS_SECRET_ACCESS_KEY="bench",  # noqa: S106 - moto dummy credentials
                AWS_DEFAULT_REGION="us-east-1",
            )
            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            aws_client("s3").create_bucket(Bucket=bucket)
            settings = JobsSettings(
                repository=args.repository,
                providers=tuple(args.providers),
                progress_bar=False,
                progress_interval_s=3600,
                work_dir=work,
            )
            rows = [
                bench_model("mlp-bench", mlp_files(mlp_rows, 4), settings, bucket, work, repeats),
                bench_model("minilm", text_files(texts, 4), settings, bucket, work, repeats),
            ]
        finally:
            moto.stop()
    print(f"Batch job vs raw ONNX Runtime ({', '.join(args.providers)}; {os.cpu_count()} CPUs)")
    print()
    print(HEADER)
    for row in rows:
        print(row.markdown())


if __name__ == "__main__":
    main()
