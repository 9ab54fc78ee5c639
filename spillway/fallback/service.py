"""What the CPU fallback does, apart from any transport: load models, answer V2 requests.

Every version each model's ``version_policy`` serves is loaded through the core loader
(downloaded from S3 into the cache, verified, warmed) at init, so a provisioned instance
answers its first request without a load; a Lambda initialised on demand loads each when
a request first needs it instead (``CPU_PRELOAD``), so its first answer waits for one
model's load, not every model's. The fallback serves the same versions as the
GPU service later too: the repository's index is read again (``CPU_INDEX_REFRESH_S``, and
at once when a request names a model or a version the last read lacked, at most once per
``CPU_INDEX_MISS_REFRESH_S``, concurrent requests sharing one read), and a model or
version published after init is loaded by the first request for it
(``spillway.models.loader.OnDemandVersions``: one load however many requests wait,
checksums verified, within ``CPU_MEMORY_BUDGET_MB``). So a model ``spillway models add``
published, or a canary the router sends here, is served, not refused. A request runs alone,
unbatched, through the core request path with the engine run directly; a ``timeout``
(microseconds, set by the router) that has passed by the time the request would run
fails it with 504 instead of computing it. A request that does not fit its model's
default version reads the index again first (at most once per
``CPU_INDEX_MISS_REFRESH_S``): after a signature replaced or rolled back, it is served by
the version published since, as on the GPU service once it loads it. Pipelines are
checked at init, or by the first request for one published since, and run their steps
over these models through the core step runner (``spillway.pipelines.serving``).

Each per-model operation looks the name up once (``CpuService.find``) and asks what
serves it, behind one interface (``CpuServed``): ``CpuModel`` for a model's versions,
``CpuPipeline`` for a pipeline. Either resolves the version a request gets before its
body is decoded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from spillway import inference
from spillway.fallback.settings import CpuSettings
from spillway.models.engine import OnnxModel
from spillway.models.loader import OnDemandVersions
from spillway.models.repository import ModelRepository, open_repository
from spillway.pipelines.runner import Resolver
from spillway.pipelines.serving import Described, PipelineSet, ServedPipeline
from spillway.pipelines.stepcache import CacheSettings, open_cache
from spillway.protocol.errors import InvalidInputError, ModelNotFoundError
from spillway.protocol.names import validate_model_name, validate_version
from spillway.protocol.v2 import server_metadata
from spillway.protocol.wire import body_over_limit, read_tenant_scope
from spillway.tenancy.proof import ScopeProofs

log = logging.getLogger("spillway.cpu_infer")

EXTENSIONS = ["binary_tensor_data", "model_configuration"]


@dataclass(frozen=True, slots=True)
class CpuCall:
    """One infer request as the fallback received it: ``arrived`` is its
    ``time.monotonic()`` arrival and ``scope`` its tenant's (a pipeline's step cache
    entries are that tenant's; ``None``: no tenant's, none was proven). The body is
    decoded only once the version is resolved."""

    body: bytes
    header_length: int | None
    max_body_bytes: int
    arrived: float
    scope: str | None

    def decode(self) -> inference.Decoded:
        return inference.decode(self.body, self.header_length, max_body_bytes=self.max_body_bytes)


class CpuServed(Described, Protocol):
    """A name the fallback serves, whatever its kind: the Open Inference Protocol's
    per-model operations (``version``: the one a request names, or ``None`` for the
    default one)."""

    def check_ready(self, version: str | None) -> None:
        """Raise unless ``version`` (or the default one) is served here."""
        ...

    def infer(self, version: str | None, call: CpuCall) -> inference.Encoded:
        """Resolve the version, then decode, validate, run and encode the request on this
        thread."""
        ...


class CpuService:
    """Served model versions and the Open Inference Protocol operations over them;
    ``models``: the versions to serve (loaded, or loaded on demand from the repository)."""

    def __init__(
        self,
        models: OnDemandVersions | Mapping[str, Mapping[int, OnnxModel]],
        settings: CpuSettings,
        pipelines: PipelineSet | None = None,
        scopes: ScopeProofs | None = None,
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
        self.pipelines = pipelines or PipelineSet()
        self._pipelines_lock = threading.Lock()
        self.scopes = scopes or ScopeProofs.from_env()
        """Verifies the router's tenant scopes (keys from ``SCOPE_PROOF_*``, cached)."""

    @classmethod
    def load(
        cls,
        settings: CpuSettings,
        repository: ModelRepository | None = None,
        scopes: ScopeProofs | None = None,
    ) -> CpuService:
        """Load (and warm) the configured models — the versions each one's policy
        serves — unless they load on demand (``CpuSettings.preloads``: a Lambda started
        on demand); read the scope proof keys (``scopes``, else from ``SCOPE_PROOF_*``)."""
        repo = repository or open_repository(settings.repository)
        cache = open_cache(CacheSettings.from_env())
        pipelines = PipelineSet.read(repo, settings.models, cache)
        budget = settings.memory_budget_mb
        versions = OnDemandVersions(
            repo,
            pipelines.models(settings.models),
            cache_dir=settings.cache_dir,
            options=settings.engine_options(),
            refresh_s=settings.index_refresh_s,
            miss_refresh_s=settings.index_miss_refresh_s,
            memory_budget_bytes=None if budget is None else int(budget * 1e6),
        )
        if settings.preloads():
            versions.preload()
        scopes = scopes or ScopeProofs.from_env()
        scopes.prime()  # at init, so a provisioned instance's first request needs no read
        return cls(versions, settings, pipelines, scopes)

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

    def find(self, name: str) -> CpuServed:
        """What serves ``name``: a pipeline (503 with the reason for one refused at
        load), else a model's versions (404, when asked, for an unknown one)."""
        pipeline = self.pipelines.find(name, None) or self._published_pipeline(name)
        if pipeline is not None:
            return CpuPipeline(self.pipelines, pipeline, self.get)
        return CpuModel(self, name)

    def _published_pipeline(self, name: str) -> ServedPipeline | None:
        """A pipeline published since init, checked and served from now on: the name's
        index (read on a miss, as for a model) says it is one; ``None`` otherwise."""
        repository = self.versions.repository
        if repository is None:
            return None
        config = self.versions.index(validate_model_name(name)).config
        if not config.is_pipeline:
            return None
        with self._pipelines_lock:  # concurrent first requests check it once
            if self.pipelines.find(name, None) is None:
                self.pipelines.add(repository, config)
            return self.pipelines.find(name, None)

    def newer(self, name: str, served: OnnxModel) -> OnnxModel | None:
        """For a request that does not fit ``served`` (the default version): the
        default version after the model's index is read again (a signature replaced or
        rolled back since), ``None`` when it is still ``served`` or was read too
        recently (``OnDemandVersions.reread``)."""
        if not self.versions.reread(validate_model_name(name)):
            return None
        model = self.get(name, None)
        return None if model is served else model

    def check_ready(self, name: str, version: str | None) -> None:
        """Raise unless the model (or pipeline) serves ``version`` (or its default one);
        a served version not loaded yet is ready: the request that needs it loads it."""
        self.find(name).check_ready(version)

    def metadata(self, name: str, version: str | None) -> dict[str, Any]:
        """``GET /v2/models/{m}[/versions/{v}]``: every served version is listed."""
        return self.find(name).metadata(version)

    def config(self, name: str, version: str | None) -> dict[str, Any]:
        """``GET /v2/models/{m}[/versions/{v}]/config``."""
        return self.find(name).config(version)

    def infer(
        self,
        name: str,
        version: str | None,
        body: bytes,
        header_length: int | None,
        *,
        arrived: float | None = None,
        tenant_scope: str | None = None,
        stored_scope: str | None = None,
    ) -> inference.Encoded:
        """Run one request through the core request path, computing it on this thread.
        ``tenant_scope`` is the tenant scope value a door received (the router signs it):
        a pipeline's step cache entries are the tenant's whose scope it proves, and a
        request it proves nothing for uses no tenant's entries. ``stored_scope`` is the
        scope of an async record the router stored (trusted as stored; never a
        client's)."""
        arrived = time.monotonic() if arrived is None else arrived
        limit = self.settings.max_payload_bytes
        scope = (
            read_tenant_scope(stored_scope)
            if stored_scope is not None
            else self.scopes.verify(tenant_scope)
        )
        call = CpuCall(body, header_length, limit, arrived, scope)
        encoded = self.find(name).infer(version, call)
        if len(encoded.body) > limit:
            raise body_over_limit(len(encoded.body), limit, "response body")
        return encoded


@dataclass(frozen=True, slots=True)
class CpuModel:
    """A model behind ``CpuServed``: its served versions, each loaded by the first
    request that needs it; a request runs alone on the engine."""

    service: CpuService
    name: str

    def check_ready(self, version: str | None) -> None:
        number = None if version is None else validate_version(version)
        index = self.service.versions.index(validate_model_name(self.name), missing=number)
        if number is not None and number not in index.versions:
            raise ModelNotFoundError(f"model {self.name!r} has no version {number} loaded")

    def metadata(self, version: str | None) -> dict[str, Any]:
        document = self.service.get(self.name, version).metadata()
        if version is None:
            document["versions"] = [str(v) for v in self.service.served_versions(self.name)]
        return document

    def config(self, version: str | None) -> dict[str, Any]:
        if version is None:  # the configuration as read: nothing loads to answer it
            return self.service.versions.index(validate_model_name(self.name)).config.to_json_dict()
        return self.service.get(self.name, version).config.to_json_dict()

    def infer(self, version: str | None, call: CpuCall) -> inference.Encoded:
        model = self.service.get(self.name, version)
        decoded = call.decode()
        try:
            admitted = inference.admit(model, decoded)
        except InvalidInputError:
            # Versions never change, a model's default may have: a request that fits
            # the one published since is served by it, on every backend at once.
            newer = None if version is not None else self.service.newer(self.name, model)
            if newer is None:
                raise
            model, admitted = newer, inference.admit(newer, decoded)
        return inference.encode(model, admitted, inference.direct(model, call.arrived)(admitted))


@dataclass(frozen=True, slots=True)
class CpuPipeline:
    """A pipeline behind ``CpuServed``: a request runs its steps on this thread, each on
    a version of its step model that ``resolve`` gives (loaded if need be)."""

    pipelines: PipelineSet
    served: ServedPipeline
    resolve: Resolver

    def check_ready(self, version: str | None) -> None:
        self.served.version(version)

    def metadata(self, version: str | None) -> dict[str, Any]:
        self.served.version(version)
        return self.served.metadata()

    def config(self, version: str | None) -> dict[str, Any]:
        self.served.version(version)
        return self.served.config.to_json_dict()

    def infer(self, version: str | None, call: CpuCall) -> inference.Encoded:
        self.served.version(version)
        return self.pipelines.serve(
            self.served, version, call.decode(), self.resolve, call.arrived, scope=call.scope
        )
