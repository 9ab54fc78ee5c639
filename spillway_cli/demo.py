"""``make demo``: each model through the core engine on real samples."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import typer

from spillway.engine import EngineOptions, OnnxModel
from spillway.repository import LocalRepository

SENTENCES = (
    "A cat sits on the mat.",
    "A kitten is resting on a rug.",
    "The stock market fell sharply today.",
    "Shares dropped steeply in early trading.",
    "How do I reset my password?",
)


def load(repo: LocalRepository, name: str, options: EngineOptions) -> OnnxModel:
    """The newest version of a model, verified and loaded."""
    version = repo.list_versions(name)[-1]
    path = repo.fetch_version(name, version, cache_dir=repo.root)
    return OnnxModel(name, version, repo.read_config(name), path, options)


def digits_accuracy(model: OnnxModel, samples: Path) -> tuple[float, int]:
    """Held-out accuracy, computed through the engine in batches of max_batch_size."""
    images = np.load(samples / "images.npy", allow_pickle=False).astype(np.float32)
    labels = np.load(samples / "labels.npy", allow_pickle=False)
    step = model.config.max_batch_size
    predicted = np.concatenate(
        [
            model.infer({"image": images[i : i + step]})["label"][:, 0]
            for i in range(0, len(images), step)
        ]
    )
    return float((predicted == labels).mean()), len(labels)


def similarity_table(model: OnnxModel) -> str:
    """Cosine similarities of the demo sentences (embeddings are L2-normalised)."""
    texts = np.array([[s.encode()] for s in SENTENCES], dtype=np.object_)
    embeddings = np.asarray(model.infer({"text": texts})["embedding"], dtype=np.float32)
    sims = embeddings @ embeddings.T
    head = "      " + " ".join(f"  s{i}  " for i in range(len(SENTENCES)))
    rows = [f"  s{i}  " + " ".join(f"{v:6.3f} " for v in sims[i]) for i in range(len(SENTENCES))]
    legend = [f"  s{i}: {s}" for i, s in enumerate(SENTENCES)]
    return "\n".join([head, *rows, "", *legend])


def run_demo(repository: Path) -> None:
    """Load each model from the repository and show what it predicts."""
    repo = LocalRepository(repository)
    options = EngineOptions()
    digits = load(repo, "digits", options)
    accuracy, count = digits_accuracy(digits, repository / "digits" / "samples")
    typer.echo(
        f"digits v{digits.version} on {digits.provider}: accuracy {accuracy:.4f} "
        f"on {count} held-out images"
    )

    minilm = load(repo, "minilm", options)
    typer.echo(f"\nminilm v{minilm.version} on {minilm.provider}: cosine similarity")
    typer.echo(similarity_table(minilm))

    mlp = load(repo, "mlp-bench", options)
    batch = mlp.sample_inputs(64)
    started = time.perf_counter()
    out = mlp.infer(batch)["output"]
    elapsed = time.perf_counter() - started
    typer.echo(
        f"\nmlp-bench v{mlp.version}: batch of 64 -> output {list(out.shape)} "
        f"in {elapsed * 1e3:.2f} ms (mean {float(out.mean()):+.4f})"
    )
