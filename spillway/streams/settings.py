"""Settings of the WebSocket API: ``StreamSettings`` (``WS_<FIELD>``).

A plain pydantic model filled by ``from_env`` (as ``AsyncSettings``), not a
pydantic-settings class: the WebSocket handler builds the router's settings too, and
importing pydantic-settings would cost its cold start 70-100 ms.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from spillway.aws.limits import WS_MESSAGE_BYTES
from spillway.envsettings import prefixed_values

ENV_PREFIX = "WS_"


class StreamSettings(BaseModel):
    """Settings of the WebSocket API (``WS_<FIELD>`` in the environment)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_in_flight: int = Field(default=32, ge=1, le=1000)
    """Frames of one connection received and not yet answered (answers held for ordering
    included); a frame past it is answered at once with 429 ``slow_down``."""
    max_message_bytes: int = Field(default=WS_MESSAGE_BYTES, ge=1024, le=WS_MESSAGE_BYTES)
    """Largest frame accepted (its UTF-8 bytes) and answer pushed; larger: 413
    ``message_too_large``. API Gateway's own limit (``WS_MESSAGE_BYTES``, 128 KiB) closes
    the connection on a larger message before the function sees it."""
    connection_ttl_s: int = Field(default=10_800, ge=60, le=7 * 86_400)
    """Life of a connection's state item (``expires_at``): API Gateway closes a connection
    after 2 hours, so 3 hours leaves a margin; past it a frame is 401 ``not_connected``."""
    held_ttl_s: int = Field(default=900, ge=10, le=86_400)
    """Life of an answer held for ordering (and of a seq's reservation) when nobody
    delivers it (its connection gone without a ``$disconnect``)."""
    lease_s: float = Field(default=30.0, gt=0, le=900)
    """How long one invocation holds a connection's delivery lease without renewing it;
    a lease left by an invocation that died is taken over after this time."""
    tenant_max_connections: int = Field(default=100, ge=1, le=100_000)
    """Connections one tenant may hold open at once (all its clients together); one more
    is refused at ``$connect`` with 429 ``too_many_connections`` (API Gateway refuses the
    upgrade with that status). Closed ones count out at ``$disconnect``; one whose
    ``$disconnect`` never came counts out once its item is gone or 2 h 5 min passed."""
    tenant_max_in_flight: int = Field(default=128, ge=1, le=10_000)
    """Frames of one tenant being served at once (all its connections together); a frame
    past it is answered at once with 429 ``slow_down`` before it is routed."""
    tenant_frame_rate: float = Field(default=200.0, gt=0, le=100_000)
    """Frames per second one tenant may have served, on average (all its connections
    together); a frame past it (and past ``tenant_frame_burst``) is answered at once with
    429 ``slow_down`` and ``retry_after_s``, before it is routed."""
    tenant_frame_burst: int = Field(default=400, ge=1, le=100_000)
    """Frames one tenant may send at once above ``tenant_frame_rate`` (the bucket's size)."""
    management_endpoint: str | None = None
    """Where answers are posted (the ``@connections`` API), e.g. ``http://127.0.0.1:3001``
    for local runs; unset: ``https://{domainName}/{stage}`` of the event."""
    tracing: bool = False
    """Create the X-Ray tracer for the WebSocket function (imported only when true)."""

    @field_validator("management_endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if not value:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{value!r} is not an http(s) URL with a host")
        return value.rstrip("/")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> StreamSettings:
        """Settings from ``WS_*`` variables (empty values count as unset)."""
        return cls.model_validate(prefixed_values(cls, ENV_PREFIX, environ))
