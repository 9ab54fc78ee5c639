"""The minilm graph written with onnx.helper: real ONNX Runtime against the numpy reference.

minilm is built once, fresh, in a separate interpreter (so the test also sees which
modules the build imported). The comparison with sentence-transformers runs only where the
export environment is installed: .venv-export (SPILLWAY_EXPORT_PYTHON), or this interpreter.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from numpy.typing import NDArray
from tokenizers import Tokenizer

from spillway_cli.modelbuild import minilm
from spillway_cli.modelbuild.bert_graph import BertConfig, load_bert, parse_safetensors
from spillway_cli.modelbuild.bert_reference import sentence_embeddings

ROOT = Path(__file__).resolve().parents[2]
EXPORT_ONLY = ("torch", "transformers", "sentence_transformers")
# Runs in the export environment's interpreter: sentence-transformers only, no spillway.
_ENCODE_SCRIPT = (
    "import json, sys\n"
    "import numpy as np\n"
    "from sentence_transformers import SentenceTransformer\n"
    "model = SentenceTransformer(sys.argv[1], device='cpu')\n"
    "texts = json.load(sys.stdin)\n"
    "embeddings = model.encode(texts, normalize_embeddings=True, show_progress_bar=False)\n"
    "np.save(sys.argv[2], np.asarray(embeddings, dtype=np.float32), allow_pickle=False)\n"
)
GRAPH_TOLERANCE = 1e-5  # seen: ~3e-7; the build itself accepts minilm.MAX_ABS_DIFF

# Different from minilm.VERIFY_SENTENCES; lengths from 3 to well over 100 tokens.
SENTENCES = [
    "How do I reset my password?",
    "Tokyo",
    "Autoscaling adds GPU workers when the queue grows and removes them when it drains; "
    "each worker loads the models it serves from the repository at start-up, checks their "
    "digests against SHA256SUMS, and only then reports ready to the router, which keeps "
    "sending the overflow to the CPU fallback until at least one worker answers its health "
    "probe twice in a row without a timeout or an error of any kind.",
    "Das Wetter in München ist heute überraschend mild — 18 °C!",
    "404",
]
PARAPHRASES = [
    (
        "A man is playing a guitar.",
        "Someone is strumming a guitar.",
        "The stock market fell today.",
    ),
    ("How old are you?", "What is your age?", "Where can I buy fresh bread?"),
]


@dataclass(frozen=True)
class Built:
    """A freshly built minilm and what its build imported."""

    session: ort.InferenceSession
    model: onnx.ModelProto
    tokenizer: Tokenizer
    export_modules_imported: list[str]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    out = tmp_path_factory.mktemp("minilm-graph")
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from spillway_cli.modelbuild.minilm import build_minilm\n"
        "build_minilm(Path(sys.argv[1]))\n"
        f"heavy = {EXPORT_ONLY!r}\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in heavy)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    version_dir = out / "minilm" / "1"
    path = version_dir / "model.onnx"
    return Built(
        session=ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]),
        model=onnx.load(str(path)),
        tokenizer=Tokenizer.from_file(str(version_dir / "tokenizer.json")),
        export_modules_imported=json.loads(done.stdout.strip().splitlines()[-1]),
    )


@pytest.fixture(scope="module")
def source() -> tuple[BertConfig, dict[str, NDArray[np.generic]]]:
    return load_bert(minilm.source_model_path())


def _cosine(a: NDArray[np.float32], b: NDArray[np.float32]) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_build_needs_no_export_environment(built: Built) -> None:
    # GIVEN / WHEN minilm was built in a fresh interpreter
    # THEN neither torch, transformers nor sentence-transformers was imported
    assert built.export_modules_imported == []


def test_graph_contract(built: Built) -> None:
    # GIVEN the built model
    model, session = built.model, built.session

    # WHEN its signature is read
    inputs = [(i.name, i.type, i.shape) for i in session.get_inputs()]
    outputs = [(o.name, o.type, o.shape) for o in session.get_outputs()]

    # THEN it is the served contract: dynamic int64 token batches in, [batch, 384] out
    assert inputs == [
        ("input_ids", "tensor(int64)", ["batch", "sequence"]),
        ("attention_mask", "tensor(int64)", ["batch", "sequence"]),
    ]
    assert outputs == [("embedding", "tensor(float)", ["batch", 384])]
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
    assert model.ir_version == 8
    # Linear weights were transposed at build time: no Transpose reads an initializer.
    initializers = {i.name for i in model.graph.initializer}
    assert not any(
        n.op_type == "Transpose" and n.input[0] in initializers for n in model.graph.node
    )


def test_graph_matches_numpy_reference_padded_and_alone(
    built: Built, source: tuple[BertConfig, dict[str, NDArray[np.generic]]]
) -> None:
    # GIVEN sentences of very different lengths, tokenised as one padded batch
    config, weights = source
    input_ids, attention_mask = minilm.token_batch(built.tokenizer, SENTENCES)
    assert (attention_mask == 0).any(), "the batch should contain padding"

    # WHEN ONNX Runtime and the numpy reference embed them padded and one at a time
    onnx_batched = minilm.onnx_embed(built.session, built.tokenizer, SENTENCES)
    onnx_alone = np.concatenate(
        [minilm.onnx_embed(built.session, built.tokenizer, [s]) for s in SENTENCES]
    )
    reference_batched = sentence_embeddings(config, weights, input_ids, attention_mask)
    reference_alone = np.concatenate(
        [minilm.reference_embed(config, weights, built.tokenizer, [s]) for s in SENTENCES]
    )

    # THEN all four agree, and the embeddings are unit vectors that differ between sentences
    assert onnx_batched.shape == (len(SENTENCES), 384)
    assert onnx_batched.dtype == np.float32
    for got in (onnx_batched, onnx_alone, reference_batched):
        assert float(np.max(np.abs(got - reference_alone))) <= GRAPH_TOLERANCE
    np.testing.assert_allclose(np.linalg.norm(onnx_batched, axis=1), 1.0, atol=1e-5)
    similarities = onnx_batched @ onnx_batched.T
    assert float(similarities[~np.eye(len(SENTENCES), dtype=bool)].max()) < 0.99


@pytest.mark.parametrize(("anchor", "paraphrase", "unrelated"), PARAPHRASES)
def test_paraphrase_is_closer_than_an_unrelated_sentence(
    built: Built, anchor: str, paraphrase: str, unrelated: str
) -> None:
    # GIVEN a sentence, a paraphrase of it and an unrelated sentence
    # WHEN the three are embedded through the built graph
    a, p, u = minilm.onnx_embed(built.session, built.tokenizer, [anchor, paraphrase, unrelated])

    # THEN the paraphrase is nearer by cosine similarity
    assert _cosine(a, p) > _cosine(a, u)
    assert _cosine(p, a) > _cosine(p, u)


def test_safetensors_reader_reads_f32_and_i64_and_skips_metadata() -> None:
    # GIVEN a hand-written safetensors file with metadata, an F32 and an I64 tensor
    f32 = np.arange(6, dtype="<f4").reshape(2, 3)
    i64 = np.array([7, -1], dtype="<i8")
    header = {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "I64", "shape": [2], "data_offsets": [24, 40]},
    }
    raw = json.dumps(header).encode()
    data = struct.pack("<Q", len(raw)) + raw + f32.tobytes() + i64.tobytes()

    # WHEN it is parsed
    tensors = parse_safetensors(data)

    # THEN both tensors come back with their dtypes, shapes and values
    assert sorted(tensors) == ["a", "b"]
    np.testing.assert_array_equal(tensors["a"], f32)
    np.testing.assert_array_equal(tensors["b"], i64)
    assert (tensors["a"].dtype, tensors["b"].dtype) == (np.dtype(np.float32), np.dtype(np.int64))


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}, "not supported"),
        ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, "do not hold"),
        ({"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "outside the data"),
        ({"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}, "non-negative"),
    ],
)
def test_safetensors_reader_refuses_what_it_cannot_read(
    entry: dict[str, object], message: str
) -> None:
    # GIVEN a file of 8 data bytes whose one entry is unsupported or inconsistent
    raw = json.dumps({"x": entry}).encode()
    data = struct.pack("<Q", len(raw)) + raw + bytes(8)

    # WHEN / THEN parsing refuses it with a ValueError that names the problem
    with pytest.raises(ValueError, match=message):
        parse_safetensors(data)


def _sentence_transformers_embeddings(
    texts: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> NDArray[np.float32]:
    """sentence-transformers' own embeddings, offline: in the export environment
    (SPILLWAY_EXPORT_PYTHON, which `make test` names) or else in this interpreter; skips
    where neither has sentence-transformers."""
    model_dir = str(minilm.source_model_path())
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    export_python = os.environ.get("SPILLWAY_EXPORT_PYTHON", "")
    if export_python:
        assert os.access(export_python, os.X_OK), f"SPILLWAY_EXPORT_PYTHON={export_python}"
        out = tmp_path / "sentence_transformers.npy"
        done = subprocess.run(
            [export_python, "-c", _ENCODE_SCRIPT, model_dir, str(out)],
            input=json.dumps(texts),
            env={**os.environ, **offline},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return np.asarray(np.load(out, allow_pickle=False), dtype=np.float32)
    for name, value in offline.items():  # read when the packages are first imported
        monkeypatch.setenv(name, value)
    pytest.importorskip("sentence_transformers", reason="no export environment (make export-env)")
    from sentence_transformers import SentenceTransformer

    reference_model = SentenceTransformer(model_dir, device="cpu")
    return np.asarray(
        reference_model.encode(
            texts, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
        ),
        dtype=np.float32,
    )


def test_graph_matches_sentence_transformers(
    built: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN sentence-transformers' embeddings of the sentences, from the bundled model
    reference = _sentence_transformers_embeddings(SENTENCES, tmp_path, monkeypatch)

    # WHEN the same sentences are embedded through the built graph
    got = minilm.onnx_embed(built.session, built.tokenizer, SENTENCES)

    # THEN they agree to 1e-4
    assert reference.shape == got.shape
    assert float(np.max(np.abs(got - reference))) <= 1e-4
