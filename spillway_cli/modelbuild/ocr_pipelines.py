"""``ocr-lines`` and the ``ocr`` and ``ocr-topics`` pipelines built on the OCR models.

* ``ocr-lines`` (kind ``ocr_lines``): a page's recognised rows in, its lines with the
  spaces between words put back and the page's text out (``spillway.models.ocr``). Its
  graph is an identity over one number per line, written here.
* ``ocr``: ``image`` -> ``ocr-det`` -> ``ocr-cls`` over the crops -> ``ocr-rec`` over
  the upright crops -> ``ocr-lines`` -> ``text`` ``[N, 1]``, ``boxes`` ``[N, 4, 2]``,
  ``scores`` ``[N, 1]`` and ``counts`` ``[1]`` (N). One image a request
  (``max_batch_size`` 0): the mapped steps' rows are flat, N per page.
* ``ocr-topics``: the same steps, then ``minilm`` and ``topics-head`` over the page's
  text (mapped over ``page``, one row) -> ``label`` ``[1, 1]``, ``scores`` ``[1, 6]`` and
  ``text`` ``[1, 1]``, the page as read. Built after ``topics`` (it reads its models).

Each pipeline is loaded as written (``read_pipeline``) before the build reports it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from spillway.models.config import ModelConfig, SpillwayBlock, TensorConfig
from spillway.models.engine import EngineOptions, OnnxModel
from spillway.models.pipeline_schema import (
    PipelineScheduling,
    PipelineStep,
    SchedulingOptions,
    StepMap,
    StepOptions,
)
from spillway.models.repository import LocalRepository
from spillway.pipelines.graph import read_pipeline
from spillway_cli.modelbuild import minilm, topics
from spillway_cli.modelbuild.common import (
    ONNX_FILE,
    VERSION,
    BuildReport,
    log_report,
    make_report,
    save_onnx,
    staged_model_dir,
    write_checksums,
    write_config,
)
from spillway_cli.modelbuild.ocr import CLS, DET, REC, build_ocr_rec, render_lines
from spillway_cli.modelbuild.topics_data import LABELS

logger = logging.getLogger(__name__)

LINES = "ocr-lines"
OCR = "ocr"
OCR_TOPICS = "ocr-topics"
CHECK_WORDS = "Spillway reads words"
MAX_LINES = 256
"""Text lines (crops) one page may send through orientation and recognition: a dense
A4 page has 60-100, a two-column one about 200 (docs/ocr.md); a page of thousands of
tiny marks is refused (413 ``fanout_too_large``) before its crops are read."""
PAGE_TIMEOUT_S = 60.0
"""The longest one page may take through a reading pipeline (a request may ask less)."""
PAGE_BUDGET_MS = 28_000.0
"""The latency budget the reading pipelines declare: how long the router waits for a
page whose request states none (its default, 5 s, is an interactive call's). Measured on
the CPU fallback on a 2-core machine busy with other work (load average 11): a page of 8
lines took 3.6-5.0 s, of 30 lines 16-18 s, where 8 lines take 0.7-0.8 s on an idle one
(docs/ocr.md). 28 s is what the router function can give: its 29 s (API Gateway's limit)
less the 150 ms it keeps to answer, so the budget, not the invocation, is what a 504
names; a page that needs longer goes async or to a batch job."""


def _tensor(name: str, data_type: str, *dims: int) -> TensorConfig:
    return TensorConfig(name=name, data_type=data_type, dims=dims)


def lines_config() -> ModelConfig:
    """``ocr-lines``: a page's rows in (``max_batch_size`` 0); lines, page and 1 out."""
    rows = [_tensor(n, "TYPE_STRING", -1, 1) for n in ("text", "char_positions", "crops")]
    return ModelConfig(
        name=LINES,
        max_batch_size=0,
        input=tuple(rows),
        output=(
            _tensor("lines", "TYPE_STRING", -1, 1),
            _tensor("page", "TYPE_STRING", 1, 1),
            _tensor("pages", "TYPE_INT32", 1),
        ),
        spillway=SpillwayBlock(
            kind="ocr_lines",
            description="a page's recognised text lines in; the lines with the spaces "
            "between words put back, and the page's text, out",
        ),
    )


def lines_graph() -> onnx.ModelProto:
    """An identity over one number per line: ``ocr_lines`` does its work around it."""
    x = helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["lines"])
    y = helper.make_tensor_value_info("rows_out", TensorProto.FLOAT, ["lines"])
    graph = helper.make_graph(
        [helper.make_node("Identity", ["rows"], ["rows_out"])], LINES, [x], [y]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _mapped(
    model: str,
    inputs: dict[str, str],
    outputs: dict[str, str],
    over: str,
    counts: str,
    max_rows: int = MAX_LINES,
) -> PipelineStep:
    return PipelineStep(
        model_name=model,
        input_map=inputs,
        output_map=outputs,
        spillway=StepOptions(map=StepMap(over=(over,), counts=counts, max_rows=max_rows)),
    )


def _reading_steps(scores: str, page_outputs: dict[str, str]) -> tuple[PipelineStep, ...]:
    """image -> det -> cls over the crops -> rec over the upright crops -> lines."""
    return (
        PipelineStep(
            model_name=DET.name,
            input_map={"image": "image"},
            output_map={"boxes": "boxes", "crops": "crops", "counts": "counts"},
        ),
        _mapped(CLS.name, {"crops": "crops"}, {"crops": "upright"}, "crops", "counts"),
        _mapped(
            REC.name,
            {"crops": "upright"},
            {"text": "raw_text", "text_score": scores, "char_positions": "char_positions"},
            "upright",
            "counts",
        ),
        PipelineStep(
            model_name=LINES,
            input_map={"text": "raw_text", "char_positions": "char_positions", "crops": "upright"},
            output_map=page_outputs,
        ),
    )


def ocr_config() -> ModelConfig:
    """The ``ocr`` pipeline: one image in; its lines, boxes, scores and count out."""
    return ModelConfig(
        name=OCR,
        platform="ensemble",
        max_batch_size=0,
        input=(_tensor("image", "TYPE_STRING", 1),),
        output=(
            _tensor("text", "TYPE_STRING", -1, 1),
            _tensor("boxes", "TYPE_FP32", -1, 4, 2),
            _tensor("scores", "TYPE_FP32", -1, 1),
            _tensor("counts", "TYPE_INT32", 1),
        ),
        ensemble_scheduling=PipelineScheduling(
            step=_reading_steps("scores", {"lines": "text"}),
            spillway=SchedulingOptions(timeout_s=PAGE_TIMEOUT_S),
        ),
        spillway=SpillwayBlock(
            description="PP-OCR on one JPEG/PNG: text lines with word spaces in reading "
            "order, their boxes and recognition scores",
            latency_budget_ms=PAGE_BUDGET_MS,
        ),
    )


def ocr_topics_config() -> ModelConfig:
    """The ``ocr-topics`` pipeline: one image in; the page's topic, scores and text out."""
    return ModelConfig(
        name=OCR_TOPICS,
        platform="ensemble",
        max_batch_size=0,
        input=(_tensor("image", "TYPE_STRING", 1),),
        output=(
            _tensor("label", "TYPE_STRING", -1, 1),
            _tensor("scores", "TYPE_FP32", -1, len(LABELS)),
            _tensor("text", "TYPE_STRING", -1, 1),
        ),
        ensemble_scheduling=PipelineScheduling(
            step=(
                *_reading_steps("line_scores", {"page": "text", "pages": "pages"}),
                _mapped(
                    minilm.NAME, {"text": "text"}, {"embedding": "embedding"}, "text", "pages", 1
                ),
                _mapped(
                    topics.HEAD,
                    {"embedding": "embedding"},
                    {"label": "label", "scores": "scores"},
                    "embedding",
                    "pages",
                    1,
                ),
            ),
            spillway=SchedulingOptions(timeout_s=PAGE_TIMEOUT_S),
        ),
        spillway=SpillwayBlock(
            description="the text of one JPEG/PNG (PP-OCR, word spaces, lines joined) "
            "classified by topics: label, scores and the text read",
            latency_budget_ms=PAGE_BUDGET_MS,
        ),
    )


def _check_lines(out: Path, model: OnnxModel) -> dict[str, float]:
    """ocr-rec reads a small rendered line (dropping spaces), ocr-lines puts them back."""
    crops = np.array([[render_lines([CHECK_WORDS], size=16, pad=4)]], dtype=np.object_)
    rec = OnnxModel(REC.name, int(VERSION), REC.config, out / REC.name / VERSION, EngineOptions())
    read = rec.infer({"crops": crops})
    found = model.infer(
        {"text": read["text"], "char_positions": read["char_positions"], "crops": crops}
    )
    if found["page"][0, 0].decode() != CHECK_WORDS or found["pages"].tolist() != [1]:
        raise RuntimeError(f"ocr-lines: read {found['page'][0, 0]!r}, not {CHECK_WORDS!r}")
    return {
        "spaces_put_back": float(found["page"][0, 0].count(b" ") - read["text"][0, 0].count(b" "))
    }


def build_ocr_lines(out: Path) -> BuildReport:
    """Write and check ``out/ocr-lines`` (building ``ocr-rec`` first when ``out`` has
    none: the check reads a line with it); raises RuntimeError on a failed check."""
    started = time.monotonic()
    if not (out / REC.name / "config.json").is_file():
        build_ocr_rec(out)
    with staged_model_dir(out, LINES) as model_dir:
        version_dir = model_dir / VERSION
        save_onnx(lines_graph(), version_dir / ONNX_FILE)
        write_checksums(version_dir)
        write_config(model_dir, lines_config())
        served = OnnxModel(LINES, int(VERSION), lines_config(), version_dir, EngineOptions())
        report = make_report(LINES, version_dir, _check_lines(out, served), started)
    log_report(report)
    return report


def _build_pipeline(out: Path, config: ModelConfig) -> BuildReport:
    started = time.monotonic()
    with staged_model_dir(out, config.name) as model_dir:
        (model_dir / VERSION).mkdir()
        write_checksums(model_dir / VERSION)  # a pipeline version holds no files
        write_config(model_dir, config)
    pipeline = read_pipeline(LocalRepository(out), config)  # it loads as written
    report = make_report(
        config.name, out / LINES / VERSION, {"steps": float(len(pipeline.steps))}, started
    )
    log_report(report)
    return report


def build_ocr_pipeline(out: Path) -> BuildReport:
    """Write ``out/ocr`` (needs ocr-det, ocr-cls, ocr-rec and ocr-lines built)."""
    return _build_pipeline(out, ocr_config())


def build_ocr_topics(out: Path) -> BuildReport:
    """Write ``out/ocr-topics`` (needs the OCR models, minilm and topics-head built)."""
    return _build_pipeline(out, ocr_topics_config())
