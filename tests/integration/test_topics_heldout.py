"""``topics`` on its held-out set: per-label precision and recall of the real built models.

``topics-head`` is built here from the repository's ``minilm`` and ``config/topics/train.jsonl``
(as ``make models`` builds it), then the sentences of ``config/topics/heldout.jsonl`` go
through ``minilm`` and ``topics-head`` on ONNX Runtime, each opened as it serves. The
demo's sentences go through the ``topics`` pipeline of the CPU fallback. Run with ``-s``
to see the table docs/moderation.md quotes.
"""

from __future__ import annotations

import base64
import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from spillway.fallback.direct import handle_direct
from spillway.fallback.service import CpuService
from spillway.fallback.settings import CpuSettings
from spillway.protocol.codec import encode_request
from spillway_cli.demo.pipelines import SENTENCES
from spillway_cli.modelbuild.common import BuildReport
from spillway_cli.modelbuild.topics import build_topics, held_out_scores
from spillway_cli.modelbuild.topics_data import (
    DESCRIPTION,
    HELDOUT_SET,
    LABELS,
    REVIEW,
    TRAIN_SET,
    LabelScore,
    format_table,
    read_examples,
    score_labels,
)
from tests.support import link_model

MIN_REVIEW_RECALL = 0.8
MIN_TOPIC_RECALL = 0.9
HARMS = {"threat", "extortion", "scam", "abuse", "weapons-drugs", "self-harm"}


@dataclass
class Built:
    """A repository with ``minilm`` and a fresh ``topics`` build, its report and log."""

    root: Path
    report: BuildReport
    logged: list[str]


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage().strip())


@pytest.fixture(scope="module")
def built(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Built:
    root = tmp_path_factory.mktemp("topics-heldout")
    link_model(models_dir, root, "minilm")
    logger = logging.getLogger("spillway_cli.modelbuild.topics")
    collect, level = _Collect(), logger.level
    logger.addHandler(collect)
    logger.setLevel(logging.INFO)
    try:
        report = build_topics(root)
    finally:
        logger.removeHandler(collect)
        logger.setLevel(level)
    return Built(root, report, collect.lines)


@pytest.fixture(scope="module")
def scores(built: Built) -> dict[str, LabelScore]:
    return held_out_scores(built.root)


def test_the_held_out_set_is_apart_from_the_training_set() -> None:
    # GIVEN the two labelled sets kept in the repository
    train, held_out = read_examples(TRAIN_SET), read_examples(HELDOUT_SET)
    # THEN they share no sentence, and the held-out set has ~20 sentences a label,
    # needs-review covering every kind of harm and topics holding everyday sentences
    # that merely mention money or technology
    assert not {e.text for e in train} & {e.text for e in held_out}
    counts = Counter(e.label for e in held_out)
    assert set(counts) == set(LABELS)
    assert min(counts.values()) >= 20
    assert {e.kind for e in held_out if e.label == REVIEW} == HARMS
    mentions = {e.kind for e in held_out if e.label != REVIEW}
    assert {"mentions-money", "mentions-technology"} <= mentions
    assert sum(e.kind == DESCRIPTION for e in train) == len(LABELS) * 6


def test_needs_review_is_caught_and_the_topics_stay_right(scores: dict[str, LabelScore]) -> None:
    # WHEN the held-out sentences go through minilm and topics-head
    print("\n" + "\n".join(format_table(scores)))
    # THEN needs-review is recalled at 0.8 or more, every other label at 0.9 or more
    assert scores[REVIEW].recall >= MIN_REVIEW_RECALL
    for label, score in scores.items():
        if label != REVIEW:
            assert score.recall >= MIN_TOPIC_RECALL, label
    assert sum(s.support for s in scores.values()) == len(read_examples(HELDOUT_SET))


def test_the_build_logs_the_held_out_figures(built: Built, scores: dict[str, LabelScore]) -> None:
    # GIVEN the report and the log of the build
    metrics = built.report.metrics
    # THEN its metrics are the held-out figures and its own training set is fitted
    assert metrics["heldout_review_recall"] == scores[REVIEW].recall
    assert metrics["heldout_review_precision"] == scores[REVIEW].precision
    assert metrics["train_accuracy"] >= 0.9
    # AND the log holds the per-label table
    assert set(format_table(scores)) <= set(built.logged)


def test_the_demo_sentences_through_the_pipeline(built: Built) -> None:
    # GIVEN the topics pipeline served by the CPU fallback
    cpu = CpuService.load(CpuSettings(repository=str(built.root)))
    texts = np.array([[t.encode()] for t, _ in SENTENCES], dtype=np.object_)
    body, _ = encode_request({"text": texts}, binary=False)
    # WHEN the demo's sentences are classified in one request
    answer = handle_direct(cpu, {"model": "topics", "body_b64": base64.b64encode(body).decode()})
    # THEN each has its hand label, the extortion sentence needs-review
    assert answer["statusCode"] == 200
    outputs = {o["name"]: o["data"] for o in json.loads(answer["body"])["outputs"]}
    assert outputs["label"] == [label for _, label in SENTENCES]
    assert (
        "Give me your card number or I will post your photos everywhere.",
        REVIEW,
    ) in SENTENCES


def test_scoring_counts_precision_and_recall_per_label() -> None:
    truth = ["animals", "animals", REVIEW, REVIEW, "finance"]
    predicted = ["animals", REVIEW, REVIEW, "finance", "finance"]
    scores = score_labels(truth, predicted)
    assert (scores["animals"].precision, scores["animals"].recall) == (1.0, 0.5)
    assert (scores[REVIEW].precision, scores[REVIEW].recall) == (0.5, 0.5)
    assert (scores["finance"].precision, scores["finance"].recall) == (0.5, 1.0)
    assert (scores["sports"].precision, scores["sports"].recall) == (1.0, 1.0)
