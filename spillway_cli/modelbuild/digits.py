"""``digits``: an 8x8 handwritten-digit classifier trained on scikit-learn's bundled set.

StandardScaler + LogisticRegression, converted with skl2onnx and edited so that the ONNX
outputs are exactly ``label`` INT64 ``[N, 1]`` and ``probabilities`` FP32 ``[N, 10]``.
The held-out split is saved as ``samples/images.npy`` (float32 ``[N, 8, 8]``, pixel
values 0..16) and ``samples/labels.npy`` (int64 ``[N]``) for demos and tests.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from spillway.models.config import (
    DynamicBatching,
    ModelConfig,
    QueuePolicy,
    SpillwayBlock,
    TensorConfig,
)
from spillway_cli.modelbuild.common import (
    ONNX_FILE,
    VERSION,
    BuildReport,
    log_report,
    make_report,
    save_npy,
    save_onnx,
    staged_model_dir,
    write_checksums,
    write_config,
)

if TYPE_CHECKING:
    import onnx

logger = logging.getLogger(__name__)

NAME = "digits"
MIN_ACCURACY = 0.95
MIN_AGREEMENT = 0.995
ONNX_OPSET = 17
ONNX_ML_OPSET = 3
_BATCH_DIM = "batch"
_RANDOM_STATE = 0


@dataclass(frozen=True)
class _Trained:
    pipeline: Any
    classifier: Any
    x_test: NDArray[np.float64]
    y_test: NDArray[np.int64]


def digits_config() -> ModelConfig:
    """The served configuration: ``image`` [8, 8] in, ``label`` and ``probabilities`` out."""
    return ModelConfig(
        name=NAME,
        max_batch_size=64,
        input=(TensorConfig(name="image", data_type="TYPE_FP32", dims=(8, 8)),),
        output=(
            TensorConfig(name="label", data_type="TYPE_INT64", dims=(1,)),
            TensorConfig(name="probabilities", data_type="TYPE_FP32", dims=(10,)),
        ),
        dynamic_batching=DynamicBatching(
            preferred_batch_size=(16, 32),
            max_queue_delay_microseconds=2000,
            priority_levels=2,
            default_priority_level=2,
            default_queue_policy=QueuePolicy(max_queue_size=256),
        ),
        spillway=SpillwayBlock(
            kind="image_classifier",
            description="8x8 digits (0-16 grey levels), StandardScaler + LogisticRegression",
        ),
    )


def _train() -> _Trained:
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.25, random_state=_RANDOM_STATE, stratify=y
    )
    classifier = LogisticRegression(max_iter=5000, random_state=_RANDOM_STATE)
    pipeline = make_pipeline(StandardScaler(), classifier).fit(x_train, y_train)
    accuracy = float(pipeline.score(x_test, y_test))
    if accuracy < MIN_ACCURACY:
        raise RuntimeError(f"digits: held-out accuracy {accuracy:.4f} < {MIN_ACCURACY}")
    return _Trained(pipeline, classifier, x_test, y_test.astype(np.int64))


def _to_onnx(trained: _Trained) -> onnx.ModelProto:
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import FloatTensorType

    model = convert_sklearn(
        trained.pipeline,
        initial_types=[("input", FloatTensorType([None, 64]))],
        options={id(trained.classifier): {"zipmap": False}},
        target_opset={"": ONNX_OPSET, "ai.onnx.ml": ONNX_ML_OPSET},
    )
    return _with_served_outputs(model)


def _rename_tensor(graph: onnx.GraphProto, old: str, new: str) -> None:
    for node in graph.node:
        node.input[:] = [new if name == old else name for name in node.input]
        node.output[:] = [new if name == old else name for name in node.output]


def _with_served_outputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """Rename the converter's outputs and give the label a trailing axis: ``[N]`` → ``[N, 1]``."""
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    graph.name = NAME  # skl2onnx names the graph with a random uuid; keep builds reproducible
    by_type = {out.type.tensor_type.elem_type: out.name for out in graph.output}
    if len(graph.output) != 2 or set(by_type) != {TensorProto.INT64, TensorProto.FLOAT}:
        raise RuntimeError(f"digits: unexpected converter outputs {list(graph.output)}")
    _rename_tensor(graph, by_type[TensorProto.INT64], "label_flat")
    _rename_tensor(graph, by_type[TensorProto.FLOAT], "probabilities")
    axes = numpy_helper.from_array(np.array([1], dtype=np.int64), name="label_axes")
    graph.initializer.append(axes)
    graph.node.append(
        helper.make_node("Unsqueeze", ["label_flat", "label_axes"], ["label"], name="label_2d")
    )
    del graph.output[:]
    graph.output.extend(
        [
            helper.make_tensor_value_info("label", TensorProto.INT64, [_BATCH_DIM, 1]),
            helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, [_BATCH_DIM, 10]),
        ]
    )
    graph.input[0].type.tensor_type.shape.dim[0].dim_param = _BATCH_DIM
    _dedupe_opsets(model)
    return model


def _dedupe_opsets(model: onnx.ModelProto) -> None:
    # skl2onnx may list the default domain twice; keep the highest version per domain.
    versions: dict[str, int] = {}
    for opset in model.opset_import:
        versions[opset.domain] = max(opset.version, versions.get(opset.domain, 0))
    del model.opset_import[:]
    for domain, version in sorted(versions.items()):
        entry = model.opset_import.add()
        entry.domain, entry.version = domain, version


def _evaluate(model: onnx.ModelProto, trained: _Trained) -> dict[str, float]:
    """Accuracy through ONNX Runtime, and its agreement with scikit-learn's predictions."""
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    label, probabilities = session.run(
        ["label", "probabilities"], {"input": trained.x_test.astype(np.float32)}
    )
    n = len(trained.y_test)
    if label.shape != (n, 1) or label.dtype != np.int64 or probabilities.shape != (n, 10):
        raise RuntimeError(
            f"digits: ONNX outputs {label.shape} {label.dtype}, {probabilities.shape}"
        )
    predicted = label[:, 0]
    agreement = float(np.mean(predicted == trained.pipeline.predict(trained.x_test)))
    if agreement < MIN_AGREEMENT:
        raise RuntimeError(f"digits: ONNX agrees with scikit-learn on only {agreement:.4f}")
    accuracy = float(np.mean(predicted == trained.y_test))
    if accuracy < MIN_ACCURACY:
        raise RuntimeError(f"digits: ONNX accuracy {accuracy:.4f} < {MIN_ACCURACY}")
    return {"accuracy": accuracy, "sklearn_agreement": agreement, "test_rows": float(n)}


def build_digits(out: Path) -> BuildReport:
    """Train, convert, verify and write ``out/digits``; raises RuntimeError on a failed check."""
    started = time.monotonic()
    trained = _train()
    model = _to_onnx(trained)
    metrics = _evaluate(model, trained)
    with staged_model_dir(out, NAME) as model_dir:
        version_dir = model_dir / VERSION
        save_onnx(model, version_dir / ONNX_FILE)
        write_checksums(version_dir)
        images = trained.x_test.reshape(-1, 8, 8).astype(np.float32)
        save_npy(model_dir / "samples" / "images.npy", images)
        save_npy(model_dir / "samples" / "labels.npy", trained.y_test)
        write_config(model_dir, digits_config())
        report = make_report(NAME, version_dir, metrics, started)
    log_report(report)
    return report
