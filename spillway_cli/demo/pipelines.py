"""The demo's pipeline section: sentences classified through the router by ``topics``.

``topics`` is a pipeline (``minilm`` then ``topics-head``, docs/pipelines.md); the router
routes it like any model. Each sentence is sent twice: the second answer is the same and
takes the embedding from the step cache (``parameters.cached_steps``).
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from spillway_cli.console import Check, equal

SENTENCES = (
    ("Our striker scored a late winner in the derby.", "sports"),
    ("The central bank kept interest rates on hold.", "finance"),
    ("My parrot learned to whistle the doorbell tune.", "animals"),
    ("The new update finally fixed the app's crash on start-up.", "technology"),
    ("A short walk after meals helps keep blood sugar steady.", "health"),
    ("Give me your card number or I will post your photos everywhere.", "needs-review"),
)


@dataclass
class TopicsReport:
    """What the section saw."""

    answered: int = 0
    correct: int = 0
    cached: int = 0
    lines: list[str] = field(default_factory=list)

    def checks(self) -> list[Check]:
        """Every sentence answered twice, the repeat from the cache."""
        return [
            equal("answers (each sentence twice)", self.answered, 2 * len(SENTENCES)),
            equal("repeats answered from the step cache", self.cached, len(SENTENCES)),
        ]

    @property
    def ok(self) -> bool:
        """Every check passed."""
        return all(check.passed for check in self.checks())


def _classify(port: int, headers: Mapping[str, str], text: str) -> tuple[int, dict[str, Any]]:
    body = {"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": [text]}]}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        sent = {"content-type": "application/json", **headers}
        conn.request("POST", "/v2/models/topics/infer", json.dumps(body).encode(), sent)
        response = conn.getresponse()
        raw = response.read()
        backend = response.getheader("x-spillway-backend", "?")
    finally:
        conn.close()
    if response.status != 200:
        return response.status, {}
    answer = json.loads(raw)
    outputs = {o["name"]: o["data"] for o in answer["outputs"]}
    cached = (answer.get("parameters") or {}).get("cached_steps", "")
    return 200, {
        "label": outputs["label"][0],
        "score": max(outputs["scores"]),
        "cached": cached,
        "backend": backend,
    }


def scenario_topics(
    port: int, headers: Mapping[str, str], say: Callable[[str], None]
) -> TopicsReport:
    """Classify ``SENTENCES`` through the router, each twice; print what came back."""
    report = TopicsReport()
    for text, expected in SENTENCES:
        answers = []
        for _ in range(2):
            started = time.monotonic()
            status, answer = _classify(port, headers, text)
            answers.append((status, answer, (time.monotonic() - started) * 1e3))
        (status, first, ms), (again_status, again, again_ms) = answers
        report.answered += (status == 200) + (again_status == 200)
        if status != 200 or again_status != 200:
            say(f"   {text!r}: {status}/{again_status}")
            continue
        report.correct += first["label"] == expected
        report.cached += again["cached"] == "0:minilm" and again["label"] == first["label"]
        say(
            f"   {first['label']:<12} {first['score']:.2f}  {text}  "
            f"[{first['backend']}, {ms:.0f} ms; again from the cache: {again_ms:.0f} ms]"
        )
    say(f"   {report.correct}/{len(SENTENCES)} as labelled by hand; {report.cached} repeats cached")
    return report
