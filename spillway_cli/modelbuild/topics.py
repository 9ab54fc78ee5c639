"""``topics``: zero-shot topic classification as a pipeline, text -> ``minilm`` -> head.

Two models are written:

* ``topics-head``: an ONNX graph made here, with no training. Its constant matrix holds
  one prototype per label: the mean ``minilm`` embedding of a few sentences describing
  the label (computed at build time through the built ``minilm``, exactly as it serves),
  L2-normalised. The graph normalises the incoming embedding, takes the cosine
  similarity with every prototype, and returns ``scores`` (softmax of the similarities
  times ``SCALE``) and ``label`` (the best label's name).
* ``topics``: the pipeline (``platform: "ensemble"``) that feeds ``text`` to ``minilm``
  (a cached step) and its ``embedding`` to ``topics-head``.

Labels, in score order: ``LABELS``. ``needs-review`` gathers what a moderation route
should hold back for a person (threats, abuse, scams, weapons, self-harm).

The build is offline and deterministic: the descriptions are fixed, ``minilm`` runs on
one thread, and the prototypes are rounded to 1e-4 before they are written.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from spillway.ensembles.graph import read_pipeline
from spillway.ensembles.schema import EnsembleScheduling, EnsembleStep, StepOptions
from spillway.models.config import (
    DynamicBatching,
    ModelConfig,
    QueuePolicy,
    SpillwayBlock,
    TensorConfig,
)
from spillway.models.engine import EngineOptions, OnnxModel
from spillway.models.repository import LocalRepository
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

if TYPE_CHECKING:
    import onnx

logger = logging.getLogger(__name__)

NAME = "topics"
HEAD = "topics-head"
SCALE = 20.0
"""Softmax temperature: cosine similarities of MiniLM sit in a narrow band."""
ONNX_OPSET = 17
MIN_SELF_ACCURACY = 0.9
LABELS: dict[str, tuple[str, ...]] = {
    "animals": (
        "Animals, pets and wildlife.",
        "A dog, a cat or another pet at home.",
        "Wild animals such as lions, whales, birds and insects in their habitat.",
        "Taking a sick pet to the veterinarian.",
        "Farm animals like cows, horses, sheep and chickens.",
        "How a species of animal hunts, feeds, migrates or raises its young.",
    ),
    "finance": (
        "Money, banking, investing and the economy.",
        "Stock markets, share prices, bonds and interest rates.",
        "Loans, mortgages, credit cards, debt and savings.",
        "Inflation, taxes and household budgets.",
        "A company's profits, quarterly earnings, revenue and funding.",
        "A central bank changing interest rates.",
    ),
    "sports": (
        "Sports, athletes and competitions.",
        "A football, basketball, baseball or tennis game and its final score.",
        "A team winning or losing a match, a league title or a championship.",
        "A runner, swimmer or cyclist training for a race.",
        "Players, coaches, referees and fans at a stadium.",
        "An athlete setting a record at the Olympics.",
    ),
    "technology": (
        "Technology, software, computers and the internet.",
        "Smartphones, laptops, apps and gadgets.",
        "Programming, bugs, servers and cloud computing.",
        "Artificial intelligence and machine learning.",
        "A software update, a new operating system version or a computer chip.",
        "A website, a web browser or an online account not working.",
    ),
    "health": (
        "Health, medicine and wellbeing.",
        "A doctor, a nurse, a hospital or a clinic.",
        "An illness, its symptoms and its treatment.",
        "Diet, exercise, sleep and mental health.",
        "Vaccines, medication and surgery.",
        "Medical research about a disease.",
    ),
    "needs-review": (
        "A threat to hurt, attack or kill someone.",
        "Hateful, abusive or insulting language aimed at a person or a group.",
        "Harassment and bullying.",
        "Weapons, explosives or illegal drugs.",
        "A scam or phishing message that asks for passwords, bank details or money.",
        "Self-harm or suicide.",
    ),
}
_DESCRIPTION = "zero-shot topics; scores in the order " + ", ".join(LABELS)


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
            description=f"cosine similarity to label prototypes; {_DESCRIPTION}"
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
        ensemble_scheduling=EnsembleScheduling(
            step=(
                EnsembleStep(
                    model_name=minilm.NAME,
                    input_map={"text": "text"},
                    output_map={"embedding": "embedding"},
                    spillway=StepOptions(cache=True),
                ),
                EnsembleStep(
                    model_name=HEAD,
                    input_map={"embedding": "embedding"},
                    output_map={"label": "label", "scores": "scores"},
                ),
            )
        ),
        spillway=SpillwayBlock(description=_DESCRIPTION),
    )


def _embedder(out: Path) -> OnnxModel:
    """The built ``minilm``, verified and opened as it serves, on one thread."""
    repository = LocalRepository(out)
    version = repository.list_versions(minilm.NAME)[-1]
    path = repository.fetch_version(minilm.NAME, version, out)
    options = EngineOptions(intra_op_threads=1, inter_op_threads=1)
    return OnnxModel(minilm.NAME, version, repository.read_config(minilm.NAME), path, options)


def embed(model: OnnxModel, texts: list[str]) -> NDArray[np.float32]:
    """Embeddings of ``texts`` through a served-model engine, one text per row."""
    column = np.array([t.encode() for t in texts], dtype=np.object_).reshape(-1, 1)
    return np.asarray(model.infer({"text": column})["embedding"], dtype=np.float32)


def prototypes(model: OnnxModel) -> NDArray[np.float32]:
    """One unit-length mean embedding per label, ``[labels, 384]``, rounded to 1e-4."""
    rows = []
    for descriptions in LABELS.values():
        mean = embed(model, list(descriptions)).astype(np.float64).mean(axis=0)
        rows.append(mean / np.linalg.norm(mean))
    return np.round(np.stack(rows), 4).astype(np.float32)


def head_graph(matrix: NDArray[np.float32]) -> onnx.ModelProto:
    """normalise -> cosine with each prototype -> softmax(scale ×) and the best label."""
    from onnx import TensorProto, helper, numpy_helper

    labels = list(LABELS)
    batch = "batch"
    nodes = [
        helper.make_node("LpNormalization", ["embedding"], ["unit"], axis=1, p=2),
        helper.make_node("MatMul", ["unit", "prototypes"], ["cosine"]),
        helper.make_node("Mul", ["cosine", "scale"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["scores"], axis=1),
        helper.make_node("ArgMax", ["scores"], ["best"], axis=1, keepdims=1),
        helper.make_node("Gather", ["names", "best"], ["label"], axis=0),
    ]
    initializers = [
        numpy_helper.from_array(np.ascontiguousarray(matrix.T), "prototypes"),
        numpy_helper.from_array(np.array(SCALE, dtype=np.float32), "scale"),
        numpy_helper.from_array(np.array([n.encode() for n in labels], dtype=np.object_), "names"),
    ]
    graph = helper.make_graph(
        nodes,
        HEAD,
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, [batch, matrix.shape[1]])],
        [
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, [batch, len(labels)]),
            helper.make_tensor_value_info("label", TensorProto.STRING, [batch, 1]),
        ],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", ONNX_OPSET)])
    model.ir_version = 8
    model.producer_name = "spillway"
    return model


def _self_check(head: onnx.ModelProto, embedder: OnnxModel) -> dict[str, float]:
    """Each label's own descriptions, through minilm and the head, come back as that
    label (a check of the graph and the prototypes, not the held-out accuracy)."""
    import onnxruntime as ort

    session = ort.InferenceSession(head.SerializeToString(), providers=["CPUExecutionProvider"])
    texts = [d for descriptions in LABELS.values() for d in descriptions]
    truth = [label for label, descriptions in LABELS.items() for _ in descriptions]
    scores, label = session.run(["scores", "label"], {"embedding": embed(embedder, texts)})
    if not np.allclose(scores.sum(axis=1), 1.0, atol=1e-5):
        raise RuntimeError("topics: the head's scores do not sum to one")
    names = list(LABELS)
    if [names[i] for i in scores.argmax(axis=1)] != [str(x) for x in label[:, 0]]:
        raise RuntimeError("topics: the head's label is not its best score")
    accuracy = float(np.mean([str(x) == t for x, t in zip(label[:, 0], truth, strict=True)]))
    if accuracy < MIN_SELF_ACCURACY:
        raise RuntimeError(f"topics: descriptions classify at {accuracy:.3f} < {MIN_SELF_ACCURACY}")
    return {"labels": float(len(names)), "description_accuracy": accuracy}


def build_topics(out: Path) -> BuildReport:
    """Write ``out/topics-head`` and the ``out/topics`` pipeline (building ``minilm`` first
    when ``out`` has none); raises RuntimeError on a failed check."""
    started = time.monotonic()
    if not (out / minilm.NAME / "config.json").is_file():
        minilm.build_minilm(out)
    embedder = _embedder(out)
    head = head_graph(prototypes(embedder))
    metrics = _self_check(head, embedder)
    with staged_model_dir(out, HEAD) as model_dir:
        save_onnx(head, model_dir / VERSION / ONNX_FILE)
        write_checksums(model_dir / VERSION)
        write_config(model_dir, head_config())
    with staged_model_dir(out, NAME) as model_dir:
        (model_dir / VERSION).mkdir()
        write_checksums(model_dir / VERSION)  # a pipeline version holds no files
        write_config(model_dir, topics_config())
    read_pipeline(LocalRepository(out), topics_config())  # the pipeline loads as written
    report = make_report(NAME, out / HEAD / VERSION, metrics, started)
    log_report(report)
    return report
