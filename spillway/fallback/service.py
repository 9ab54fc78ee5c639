"""What the CPU fallback does, apart from any transport: load models, answer V2 requests.

Every version each model's ``version_policy`` serves is loaded through the core loader
(downloaded from S3 into the cache, verified, warmed) at init, so a provisioned instance
answers its first request without a load. The fallback serves the same versions as the
GPU service later too: the repository's index is read again (``CPU_INDEX_REFRESH_S``, and
at once when a request names a version it did not list), and a version published after
init is loaded by the first request for it (``spillway.models.loader.OnDemandVersions``: one
load however many requests wait, checksums verified, within ``CPU_MEMORY_BUDGET_MB``).
So a canary the router sends here is served, not refused. A request runs alone,
unbatched, through the core request path with the engine run directly; a ``timeout``
(microseconds, set by the router) that has passed by the time the request would run
fails it with 504 instead of computing it. Ensembles are checked at init and run their
steps over these models through the core step runner (``spillway.ensembles.serving``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from spillway import inference
from spillway.ensembles.serving import EnsembleSet
from spillway.ensembles.stepcache import CacheSettings, open_cache
from spillway.fallback.settings import CpuSettings
from spillway.models.engine import OnnxModel
from spillway.models.loader import OnDemandVersions
from spillway.models.repository import ModelRepository, open_repository
from spillway.protocol.errors import ModelNotFoundError
from spillway.protocol.names import validate_model_name, validate_version
from spillway.protocol.v2 import server_metadata
from spillway.protocol.wire import body_over_limit, read_tenant_scope

log = logging.getLogger("spillway.cpu_infer")

EXTENSIONS = ["binary_tensor_data", "model_configuration"]


class CpuService:
    """Served model versions and the Open Inference Protocol operations over them;
    ``models``: the versions to serve (loaded, or loaded on demand from the repository)."""

    def __init__(
        self,
        models: OnDemandVersions | Mapping[str, Mapping[int, OnnxModel]],
        settings: CpuSettings,
        ensembles: EnsembleSet | None = None,
    ) -> None:
        if not isinstance(models, OnDemandVersions):
            models = OnDemandVersions(
                None,
                None,
                cache_dir=settings.cache_dir,
                options=settings.engine_options(),
                preloaded=models,
            )
        self.versions = models
        self.settings = settings
        self.ensembles = ensembles or EnsembleSet()

    @classmethod
    def load(cls, settings: CpuSettings, repository: ModelRepository | None = None) -> CpuService:
        """Load (and warm) the configured models: the versions each one's policy serves."""
        repo = repository or open_repository(settings.repository)
        cache = open_cache(CacheSettings.from_env())
        ensembles = EnsembleSet.read(repo, settings.models, cache)
        budget = settings.memory_budget_mb
        versions = OnDemandVersions(
            repo,
            ensembles.models(settings.models),
            cache_dir=settings.cache_dir,
            options=settings.engine_options(),
            refresh_s=settings.index_refresh_s,
            miss_refresh_s=settings.index_miss_refresh_s,
            memory_budget_bytes=None if budget is None else int(budget * 1e6),
        )
        versions.preload()
        return cls(versions, settings, ensembles)

    @property
    def models(self) -> dict[str, dict[int, OnnxModel]]:
        """The versions loaded now, by model and version."""
        return self.versions.loaded()

    def get(self, name: str, version: str | None) -> OnnxModel:
        """A served version, loaded if need be: the one asked for, else the model's
        default (the newest the policy serves; the stable one while the model's
        configuration names a canary)."""
        # Worded as the GPU service words them: every server gives the same answer.
        number = None if version is None else validate_version(version)
        return self.versions.get(validate_model_name(name), number)

    def served_versions(self, name: str) -> list[int]:
        """The versions of ``name`` served here, loaded or not (404 for an unknown one)."""
        return list(self.versions.index(validate_model_name(name)).versions)

    def server_metadata(self) -> dict[str, Any]:
        """``GET /v2``."""
        return server_metadata("spillway-cpu", EXTENSIONS)

    def check_ready(self, name: str, version: str | None) -> None:
        """Raise unless the model (or ensemble) serves ``version`` (or its default one);
        a served version not loaded yet is ready: the request that needs it loads it."""
        if self.ensembles.find(name, version) is None:
            number = None if version is None else validate_version(version)
            index = self.versions.index(validate_model_name(name), missing=number)
            if number is not None and number not in index.versions:
                raise ModelNotFoundError(f"model {name!r} has no version {number} loaded")

    def metadata(self, name: str, version: str | None) -> dict[str, Any]:
        """``GET /v2/models/{m}[/versions/{v}]``: every served version is listed."""
        if (served := self.ensembles.find(name, version)) is not None:
            return served.metadata()
        document = self.get(name, version).metadata()
        if version is None:
            document["versions"] = [str(v) for v in self.served_versions(name)]
        return document

    def config(self, name: str, version: str | None) -> dict[str, Any]:
        """``GET /v2/models/{m}[/versions/{v}]/config``."""
        if (served := self.ensembles.find(name, version)) is not None:
            return served.config.to_json_dict()
        return self.get(name, version).config.to_json_dict()

    def infer(
        self,
        name: str,
        version: str | None,
        body: bytes,
        header_length: int | None,
        *,
        arrived: float | None = None,
        tenant_scope: str | None = None,
    ) -> inference.Encoded:
        """Run one request through the core request path, computing it on this thread.
        ``tenant_scope`` is the caller's tenant scope as the router sent it (none:
        anonymous): an ensemble's step cache entries are that tenant's."""
        arrived = time.monotonic() if arrived is None else arrived
        limit = self.settings.max_payload_bytes
        scope = read_tenant_scope(tenant_scope)
        if (served := self.ensembles.find(name, version)) is not None:
            decoded = inference.decode(body, header_length, max_body_bytes=limit)
            encoded = self.ensembles.serve(served, version, decoded, self.get, arrived, scope=scope)
        else:
            model = self.get(name, version)
            decoded = inference.decode(body, header_length, max_body_bytes=limit)
            encoded = inference.run(model, decoded, inference.direct(model, arrived))
        if len(encoded.body) > limit:
            raise body_over_limit(len(encoded.body), limit, "response body")
        return encoded
