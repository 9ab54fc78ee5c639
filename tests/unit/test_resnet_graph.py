"""The GPU benchmark's ResNet-50-shaped graph: ResNet-50's layout and size, and it runs."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from bench import resnet


def test_the_full_graph_has_resnet50s_layers_and_weights() -> None:
    model = resnet.resnet50()
    kinds = [node.op_type for node in model.graph.node]
    weights = sum(int(np.prod(t.dims)) for t in model.graph.initializer)
    # 1 stem + 16 blocks x 3 + 4 projection shortcuts; 16 residual additions
    assert kinds.count("Conv") == 53
    assert kinds.count("Add") == 16
    assert 25_000_000 < weights < 26_000_000


def test_a_narrow_graph_runs_and_gives_finite_logits_per_image() -> None:
    model = resnet.resnet50(width=16, size=32)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    images = np.random.default_rng(1).standard_normal((3, 3, 32, 32), dtype=np.float32)
    (logits,) = session.run(None, {resnet.INPUT: images})
    assert logits.shape == (3, resnet.CLASSES)
    assert np.isfinite(logits).all()
    # each image its own answer
    assert not np.allclose(logits[0], logits[1])
    (alone,) = session.run(None, {resnet.INPUT: images[1:2]})
    np.testing.assert_allclose(alone[0], logits[1], rtol=1e-4, atol=1e-4)
