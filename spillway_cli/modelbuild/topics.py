"""``topics``: topic classification as a pipeline, text -> ``minilm`` -> head.

Two models are written:

* ``topics-head``: an ONNX graph made here. It normalises the incoming embedding to unit
  length and applies a multinomial logistic regression fitted at build time on the
  ``minilm`` embeddings (computed through the built ``minilm``, exactly as it serves) of
  the labelled sentences in ``config/topics/train.jsonl``; it returns ``scores`` (the
  softmax of the logits) and ``label`` (the best label's name).
* ``topics``: the pipeline (``platform: "ensemble"``) that feeds ``text`` to ``minilm``
  (a cached step) and its ``embedding`` to ``topics-head``.

Labels, in score order: ``topics_data.LABELS``. After the build, the held-out sentences
(``config/topics/heldout.jsonl``, never fitted on) are classified through the written
models and their per-label precision and recall logged (docs/moderation.md).

The build is offline and deterministic: the sentences are fixed, ``minilm`` runs on one
thread, the solver starts from zeros, and the weights are rounded to 1e-4.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from spillway.models.config import (
    DynamicBatching,
    ModelConfig,
    QueuePolicy,
    SpillwayBlock,
    TensorConfig,
)
from spillway.models.engine import EngineOptions, OnnxModel
from spillway.models.pipeline_schema import PipelineScheduling, PipelineStep, StepOptions
from spillway.models.repository import LocalRepository
from spillway.pipelines.graph import read_pipeline
from spillway_cli.modelbuild import minilm
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
from spillway_cli.modelbuild.topics_data import (
    DESCRIPTION,
    HELDOUT_SET,
    LABELS,
    REVIEW,
    TRAIN_SET,
    Example,
    LabelScore,
    format_table,
    read_examples,
    score_labels,
)

if TYPE_CHECKING:
    import onnx

logger = logging.getLogger(__name__)

NAME = "topics"
HEAD = "topics-head"
ONNX_OPSET = 17
REGULARISATION = 10.0
"""Inverse L2 strength of the logistic regression: the smallest C of 1, 3, 10, 30, 100 at
the top of 5-fold cross-validated accuracy on the training set."""
MIN_SELF_ACCURACY = 0.9
_DESCRIPTION = "topics; scores in the order " + ", ".join(LABELS)


def head_config() -> ModelConfig:
    """``embedding`` [384] in; ``scores`` [labels] and ``label`` [1] out."""
    return ModelConfig(
        name=HEAD,
        max_batch_size=64,
        input=(
            TensorConfig(name="embedding", data_type="TYPE_FP32", dims=(minilm.EMBEDDING_DIM,)),
        ),
        output=(
            TensorConfig(name="scores", data_type="TYPE_FP32", dims=(len(LABELS),)),
            TensorConfig(name="label", data_type="TYPE_STRING", dims=(1,)),
        ),
        dynamic_batching=DynamicBatching(
            preferred_batch_size=(16, 32, 64),
            max_queue_delay_microseconds=2000,
            priority_levels=2,
            default_priority_level=2,
            default_queue_policy=QueuePolicy(max_queue_size=512),
        ),
        spillway=SpillwayBlock(
            description=f"logistic regression on minilm embeddings; {_DESCRIPTION}"
        ),
    )


def topics_config() -> ModelConfig:
    """The pipeline: ``text`` -> minilm (cached) -> topics-head -> ``label``, ``scores``."""
    return ModelConfig(
        name=NAME,
        platform="ensemble",
        max_batch_size=64,
        input=(TensorConfig(name="text", data_type="TYPE_STRING", dims=(1,)),),
        output=(
            TensorConfig(name="label", data_type="TYPE_STRING", dims=(1,)),
            TensorConfig(name="scores", data_type="TYPE_FP32", dims=(len(LABELS),)),
        ),
        ensemble_scheduling=PipelineScheduling(
            step=(
                PipelineStep(
                    model_name=minilm.NAME,
                    input_map={"text": "text"},
                    output_map={"embedding": "embedding"},
                    spillway=StepOptions(cache=True),
                ),
                PipelineStep(
                    model_name=HEAD,
                    input_map={"embedding": "embedding"},
                    output_map={"label": "label", "scores": "scores"},
                ),
            )
        ),
        spillway=SpillwayBlock(description=_DESCRIPTION),
    )


def _open(out: Path, name: str) -> OnnxModel:
    """A built model of ``out``, verified and opened as it serves, on one thread."""
    repository = LocalRepository(out)
    version = repository.list_versions(name)[-1]
    path = repository.fetch_version(name, version, out)
    options = EngineOptions(intra_op_threads=1, inter_op_threads=1)
    return OnnxModel(name, version, repository.read_config(name), path, options)


def embed(model: OnnxModel, texts: Sequence[str]) -> NDArray[np.float32]:
    """Embeddings of ``texts`` through a served-model engine, one text per row, in batches
    the model accepts."""
    step = model.config.max_batch_size
    rows = []
    for start in range(0, len(texts), step):
        chunk = [t.encode() for t in texts[start : start + step]]
        column = np.array(chunk, dtype=np.object_).reshape(-1, 1)
        rows.append(np.asarray(model.infer({"text": column})["embedding"], dtype=np.float32))
    return np.concatenate(rows)


def fit_head(
    embeddings: NDArray[np.float32], labels: Sequence[str]
) -> tuple[NDArray[np.float32], NDArray[np.float32]]:
    """Weights ``[labels, 384]`` and bias ``[labels]`` of a logistic regression on the
    unit-length ``embeddings``, rounded to 1e-4."""
    from sklearn.linear_model import LogisticRegression

    unit = embeddings.astype(np.float64)
    unit /= np.linalg.norm(unit, axis=1, keepdims=True)
    target = np.array([LABELS.index(label) for label in labels])
    model = LogisticRegression(C=REGULARISATION, max_iter=5000, tol=1e-8).fit(unit, target)
    if list(model.classes_) != list(range(len(LABELS))):
        raise RuntimeError("topics: the training set lacks a label")
    weights = np.round(model.coef_, 4).astype(np.float32)
    return weights, np.round(model.intercept_, 4).astype(np.float32)


def head_graph(weights: NDArray[np.float32], bias: NDArray[np.float32]) -> onnx.ModelProto:
    """normalise -> logits (× weights + bias) -> softmax and the best label."""
    from onnx import TensorProto, helper, numpy_helper

    batch = "batch"
    nodes = [
        helper.make_node("LpNormalization", ["embedding"], ["unit"], axis=1, p=2),
        helper.make_node("MatMul", ["unit", "weights"], ["product"]),
        helper.make_node("Add", ["product", "bias"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["scores"], axis=1),
        helper.make_node("ArgMax", ["scores"], ["best"], axis=1, keepdims=1),
        helper.make_node("Gather", ["names", "best"], ["label"], axis=0),
    ]
    initializers = [
        numpy_helper.from_array(np.ascontiguousarray(weights.T), "weights"),
        numpy_helper.from_array(bias, "bias"),
        numpy_helper.from_array(np.array([n.encode() for n in LABELS], dtype=np.object_), "names"),
    ]
    graph = helper.make_graph(
        nodes,
        HEAD,
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, [batch, weights.shape[1]])],
        [
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, [batch, len(LABELS)]),
            helper.make_tensor_value_info("label", TensorProto.STRING, [batch, 1]),
        ],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", ONNX_OPSET)])
    model.ir_version = 8
    model.producer_name = "spillway"
    return model


def _accuracy(truth: Sequence[str], predicted: Sequence[str]) -> float:
    return float(np.mean([t == p for t, p in zip(truth, predicted, strict=True)]))


def _self_check(
    head: onnx.ModelProto, embeddings: NDArray[np.float32], train: Sequence[Example]
) -> dict[str, float]:
    """The head classifies its own training set, label descriptions included (a check of
    the graph and the fit, not the held-out accuracy)."""
    import onnxruntime as ort

    session = ort.InferenceSession(head.SerializeToString(), providers=["CPUExecutionProvider"])
    scores, label = session.run(["scores", "label"], {"embedding": embeddings})
    if not np.allclose(scores.sum(axis=1), 1.0, atol=1e-5):
        raise RuntimeError("topics: the head's scores do not sum to one")
    predicted = [str(x) for x in label[:, 0]]
    if [LABELS[i] for i in scores.argmax(axis=1)] != predicted:
        raise RuntimeError("topics: the head's label is not its best score")
    truth = [e.label for e in train]
    described = [i for i, e in enumerate(train) if e.kind == DESCRIPTION]
    metrics = {
        "labels": float(len(LABELS)),
        "train_sentences": float(len(train)),
        "train_accuracy": _accuracy(truth, predicted),
        "description_accuracy": _accuracy(
            [truth[i] for i in described], [predicted[i] for i in described]
        ),
    }
    for key in ("train_accuracy", "description_accuracy"):
        if metrics[key] < MIN_SELF_ACCURACY:
            raise RuntimeError(f"topics: {key} {metrics[key]:.3f} < {MIN_SELF_ACCURACY}")
    return metrics


def classify(out: Path, texts: Sequence[str]) -> list[str]:
    """The labels the built ``minilm`` and ``topics-head`` of ``out`` give ``texts``: the
    pipeline's two steps, each opened as it serves."""
    embedder, head = _open(out, minilm.NAME), _open(out, HEAD)
    embeddings = embed(embedder, texts)
    labels: list[str] = []
    for start in range(0, len(texts), head.config.max_batch_size):
        chunk = embeddings[start : start + head.config.max_batch_size]
        column = head.infer({"embedding": chunk})["label"][:, 0]
        labels.extend(x.decode() if isinstance(x, bytes) else str(x) for x in column)
    return labels


def held_out_scores(out: Path) -> dict[str, LabelScore]:
    """Per-label precision and recall of the built models of ``out`` on the held-out set."""
    held_out = read_examples(HELDOUT_SET)
    predicted = classify(out, [e.text for e in held_out])
    return score_labels([e.label for e in held_out], predicted)


def build_topics(out: Path) -> BuildReport:
    """Write ``out/topics-head`` and the ``out/topics`` pipeline (building ``minilm`` first
    when ``out`` has none); raises RuntimeError on a failed check."""
    started = time.monotonic()
    if not (out / minilm.NAME / "config.json").is_file():
        minilm.build_minilm(out)
    train = read_examples(TRAIN_SET)
    embeddings = embed(_open(out, minilm.NAME), [e.text for e in train])
    head = head_graph(*fit_head(embeddings, [e.label for e in train]))
    metrics = _self_check(head, embeddings, train)
    with staged_model_dir(out, HEAD) as model_dir:
        save_onnx(head, model_dir / VERSION / ONNX_FILE)
        write_checksums(model_dir / VERSION)
        write_config(model_dir, head_config())
    with staged_model_dir(out, NAME) as model_dir:
        (model_dir / VERSION).mkdir()
        write_checksums(model_dir / VERSION)  # a pipeline version holds no files
        write_config(model_dir, topics_config())
    read_pipeline(LocalRepository(out), topics_config())  # the pipeline loads as written
    scores = held_out_scores(out)
    logger.info("topics on the held-out set (%s):", HELDOUT_SET.name)
    for line in format_table(scores):
        logger.info("  %s", line)
    metrics["heldout_review_recall"] = scores[REVIEW].recall
    metrics["heldout_review_precision"] = scores[REVIEW].precision
    metrics["heldout_min_topic_recall"] = min(
        s.recall for s in scores.values() if s.label != REVIEW
    )
    report = make_report(NAME, out / HEAD / VERSION, metrics, started)
    log_report(report)
    return report
