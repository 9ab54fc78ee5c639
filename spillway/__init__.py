"""Spillway shared core: protocol, codecs, engine and model repository.

The core is used by the GPU service, the CPU-fallback Lambda and the batch job. It
imports only numpy, onnxruntime, pydantic, boto3 and tokenizers; it never reads
``os.environ`` and never imports a web framework or a deployable.
"""

from __future__ import annotations

__version__ = "0.1.0"
