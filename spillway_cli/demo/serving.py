"""The demo's first sections, requests the router serves at once: digits on the GPU
tier (accuracy on held-out images), minilm sentence similarity, and a serverless,
low-priority request the policy sends to the CPU fallback."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from spillway_cli.console import Check, at_least, equal
from spillway_cli.demo.client import Client, failed
from spillway_cli.demo.report import say

ACCURACY_BOUND = 0.9
"""The least accuracy the digits model may have on its held-out images (it has 0.97)."""

SENTENCES = (
    "A cat sits on the mat.",
    "A kitten is resting on a rug.",
    "The stock market fell sharply today.",
    "Shares dropped steeply in early trading.",
    "How do I reset my password?",
)


def scenario_digits(client: Client, models: Path) -> list[Check]:
    images = np.load(models / "digits/samples/images.npy", allow_pickle=False).astype(np.float32)
    labels = np.load(models / "digits/samples/labels.npy", allow_pickle=False)
    correct = 0
    for start in range(0, len(images), 16):
        status, _, out = client.infer("digits", "digits", {"image": images[start : start + 16]})
        if status != 200:
            continue
        correct += int((out["label"][:, 0] == labels[start : start + 16]).sum())
    accuracy = correct / len(labels)
    backends = {r.backend for r in client.records if r.scenario == "digits"}
    say(
        f"   accuracy {accuracy:.4f} on {len(labels)} held-out images "
        f"(served by: {', '.join(sorted(backends))})"
    )
    # The router keeps API Gateway's key check on every local runtime.
    refused = client.unrecorded("/v2/models/digits/infer", b"{}", {"x-api-key": "not-the-key"})
    say(f"   a wrong API key: {refused[0]} {refused[2].decode(errors='replace')}")
    return [
        failed([r for r in client.records if r.scenario == "digits"]),
        at_least("accuracy on the held-out images", round(accuracy, 4), ACCURACY_BOUND),
        equal(
            "a wrong API key is refused as API Gateway refuses it",
            (refused[0], refused[2]),
            (403, b'{"message":"Forbidden"}'),
        ),
    ]


def scenario_minilm(client: Client) -> list[Check]:
    texts = np.array([[s.encode()] for s in SENTENCES], dtype=np.object_)
    status, headers, out = client.infer("minilm", "minilm", {"text": texts})
    answered = [equal("the request was answered", status, 200, "(HTTP status)")]
    if status != 200:
        return answered
    emb = np.asarray(out["embedding"], dtype=np.float32)
    sims = emb @ emb.T
    say(f"   served by {headers.get('x-spillway-backend')}; cosine similarity:")
    say("      " + "".join(f"     s{i}" for i in range(len(SENTENCES))))
    for i, row in enumerate(sims):
        say(f"  s{i}  " + "".join(f"{v:7.3f}" for v in row) + f"   {SENTENCES[i]}")
    # s0/s1 and s2/s3 are paraphrases: each is closer to its own than to the other pair.
    margin = min(sims[0, 1], sims[2, 3]) - max(sims[0, 2], sims[0, 3], sims[1, 2], sims[1, 3])
    return [
        *answered,
        at_least("paraphrases closer than unrelated sentences by", round(float(margin), 3), 0.1),
    ]


def scenario_serverless(client: Client) -> list[Check]:
    image = {"image": np.zeros((1, 8, 8), np.float32)}
    status, headers, _ = client.infer(
        "serverless", "digits", image, {"x-spillway-mode": "serverless", "x-spillway-priority": "3"}
    )
    say(
        f"   answered {status}, served by "
        f"{headers.get('x-spillway-backend')} (rule {headers.get('x-spillway-rule')}, "
        f"cost ${float(headers.get('x-spillway-cost-usd', 0)):.7f})"
    )
    return [
        equal("the request was answered", status, 200, "(HTTP status)"),
        equal("the CPU fallback served it", headers.get("x-spillway-backend"), "cpu"),
    ]
