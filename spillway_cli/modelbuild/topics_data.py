"""The labelled sentences behind ``topics`` and the per-label figures they are scored by.

Two JSON Lines files in ``config/topics``, one ``{"label", "text", "kind"?}`` object a line:

* ``train.jsonl``: what the head is fitted on (``kind: "description"`` marks the one-line
  label descriptions the build also checks on their own).
* ``heldout.jsonl``: never read by the build's fitting; only scored after it, by the build
  log and by the tests. ``needs-review`` rows carry the kind of harm (``threat``,
  ``extortion``, ``scam``, ``abuse``, ``weapons-drugs``, ``self-harm``); everyday rows
  that merely mention money, technology or passwords carry ``mentions-*``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAIN_SET = ROOT / "config" / "topics" / "train.jsonl"
HELDOUT_SET = ROOT / "config" / "topics" / "heldout.jsonl"
LABELS = ("animals", "finance", "sports", "technology", "health", "needs-review")
"""The labels, in score order. ``needs-review`` gathers what a moderation route should
hold back for a person (threats, extortion, scams, abuse, weapons and drugs, self-harm)."""
REVIEW = "needs-review"
DESCRIPTION = "description"


@dataclass(frozen=True)
class Example:
    """One labelled sentence."""

    text: str
    label: str
    kind: str = ""


def read_examples(path: Path) -> list[Example]:
    """The sentences of one JSON Lines file; ValueError on an unknown label or a repeat."""
    examples: list[Example] = []
    seen: set[str] = set()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        example = Example(str(row["text"]), str(row["label"]), str(row.get("kind", "")))
        if example.label not in LABELS:
            raise ValueError(f"{path.name}:{number}: unknown label {example.label!r}")
        if example.text in seen:
            raise ValueError(f"{path.name}:{number}: repeated sentence {example.text!r}")
        seen.add(example.text)
        examples.append(example)
    return examples


@dataclass(frozen=True)
class LabelScore:
    """Precision and recall of one label over a labelled set."""

    label: str
    support: int
    predicted: int
    correct: int

    @property
    def precision(self) -> float:
        """Of the sentences given this label, the share that carry it (1.0 when none)."""
        return self.correct / self.predicted if self.predicted else 1.0

    @property
    def recall(self) -> float:
        """Of the sentences that carry this label, the share given it (1.0 when none)."""
        return self.correct / self.support if self.support else 1.0


def score_labels(truth: Sequence[str], predicted: Sequence[str]) -> dict[str, LabelScore]:
    """Per-label precision and recall of ``predicted`` against ``truth``, in label order."""
    if len(truth) != len(predicted):
        raise ValueError(f"{len(truth)} labels against {len(predicted)} predictions")
    pairs = list(zip(truth, predicted, strict=True))
    return {
        label: LabelScore(
            label,
            support=sum(t == label for t, _ in pairs),
            predicted=sum(p == label for _, p in pairs),
            correct=sum(t == p == label for t, p in pairs),
        )
        for label in LABELS
    }


def format_table(scores: dict[str, LabelScore]) -> list[str]:
    """A Markdown table: label, sentences, precision, recall."""
    lines = ["| label | sentences | precision | recall |", "|---|---:|---:|---:|"]
    for s in scores.values():
        lines.append(f"| {s.label} | {s.support} | {s.precision:.3f} | {s.recall:.3f} |")
    return lines
