"""What the CPU fallback does, apart from any transport: load models, answer V2 requests.

Every model is loaded (downloaded from S3 into the cache, verified, warmed) at init, so a
provisioned instance answers its first request without a load. A request runs alone,
unbatched, through the same core engine and codecs as the GPU service; a ``timeout``
parameter (microseconds, set by the router) that has passed by the time the request
would run fails it with 504 instead of computing it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from functions.cpu_infer.settings import CpuSettings
from spillway import __version__
from spillway.codec import (
    binary_outputs_requested,
    decode_request,
    encode_response,
    requested_outputs,
)
from spillway.engine import OnnxModel
from spillway.errors import (
    DeadlineExceededError,
    InvalidInputError,
    ModelNotFoundError,
    PayloadTooLargeError,
)
from spillway.names import validate_model_name
from spillway.names import validate_version as parse_version
from spillway.repository import ModelRepository, open_repository

log = logging.getLogger("spillway.cpu_infer")

EXTENSIONS = ["binary_tensor_data", "model_configuration"]


@dataclass(frozen=True)
class InferAnswer:
    """An encoded infer response."""

    body: bytes
    header_length: int | None
    version: int


class CpuService:
    """Loaded models and the Open Inference Protocol operations over them."""

    def __init__(self, models: dict[str, OnnxModel], settings: CpuSettings) -> None:
        self.models = models
        self.settings = settings

    @classmethod
    def load(cls, settings: CpuSettings, repository: ModelRepository | None = None) -> CpuService:
        """Load (and warm) the configured models: the newest version of each."""
        repo = repository or open_repository(settings.repository)
        names = settings.models if settings.models is not None else repo.list_models()
        models: dict[str, OnnxModel] = {}
        for name in names:
            versions = repo.list_versions(validate_model_name(name))
            if not versions:
                raise ModelNotFoundError(f"model {name!r} has no version in {repo.location}")
            version = versions[-1]
            started = time.monotonic()
            path = repo.fetch_version(name, version, settings.cache_dir)
            model = OnnxModel(
                name, version, repo.read_config(name), path, settings.engine_options()
            )
            model.infer(model.sample_inputs(1))
            models[name] = model
            log.info("loaded %s v%d in %.2f s", name, version, time.monotonic() - started)
        return cls(models, settings)

    def get(self, name: str, version: str | None) -> OnnxModel:
        """A loaded model; the version, when given, must be the loaded one."""
        model = self.models.get(validate_model_name(name))
        if model is None:
            raise ModelNotFoundError(f"model {name!r} is not served by the CPU fallback")
        if version is not None and parse_version(version) != model.version:
            raise ModelNotFoundError(f"model {name!r} has no version {version} here")
        return model

    def server_metadata(self) -> dict[str, Any]:
        """``GET /v2``."""
        return {"name": "spillway-cpu", "version": __version__, "extensions": EXTENSIONS}

    def metadata(self, name: str, version: str | None) -> dict[str, Any]:
        """``GET /v2/models/{m}[/versions/{v}]``."""
        return self.get(name, version).metadata()

    def config(self, name: str, version: str | None) -> dict[str, Any]:
        """``GET /v2/models/{m}[/versions/{v}]/config``."""
        return self.get(name, version).config.to_json_dict()

    def infer(
        self,
        name: str,
        version: str | None,
        body: bytes,
        header_length: int | None,
        *,
        arrived: float | None = None,
    ) -> InferAnswer:
        """Decode, validate, compute and encode one request."""
        arrived = time.monotonic() if arrived is None else arrived
        model = self.get(name, version)
        limit = self.settings.max_payload_bytes
        if len(body) > limit:
            raise PayloadTooLargeError(
                f"request body of {len(body)} bytes exceeds the {limit}-byte payload limit"
            )
        request, arrays = decode_request(body, header_length)
        outputs = requested_outputs(request, [o.name for o in model.config.output])
        binary = binary_outputs_requested(request, outputs)
        prepared = model.prepare(arrays)
        timeout_us = (request.parameters or {}).get("timeout")
        if timeout_us is not None:
            if isinstance(timeout_us, bool) or not isinstance(timeout_us, int) or timeout_us < 0:
                raise InvalidInputError("parameter 'timeout' must be a non-negative integer")
            if time.monotonic() - arrived > timeout_us / 1e6:
                raise DeadlineExceededError("the request's timeout passed before it could run")
        result = model.run([prepared])[0]
        out, length = encode_response(
            model.name,
            str(model.version),
            request.id,
            {n: result[n] for n in outputs},
            binary=binary,
        )
        if len(out) > limit:
            raise PayloadTooLargeError(
                f"response of {len(out)} bytes exceeds the {limit}-byte payload limit"
            )
        return InferAnswer(out, length, model.version)
