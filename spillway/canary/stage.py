"""The version-choice stage: which version of a model one request is sent to, as one
step of the router's route.

``Router.route`` reads a request, then goes through this stage's interface and nothing
else of the canary:

* ``pick`` (``VersionStage.pick``): the request's ``Arm``, the version it gets. A request
  that pins a rolled-back version is refused here; one that pins none, for a model with
  a canary record, gets the canary or the stable version (a session keeps the one it got
  first); every other request goes as it was sent.
* walk: the router walks its fallback chain with the arm's ``request``, asking the arm
  which backends to pass over (``skips``: a backend that said lately it does not serve
  the version) and which answers are no answer (``unserved``: a 404 ``model_not_found``
  for a version the client did not ask for).
* walk again on stable (``walk_again``): when no backend served the chosen canary
  version, the arm of the stable version, for the router to walk its chain again with.
* ``settle``: the outcome counted for the canary guard (which may roll the canary back)
  and the chosen version named on the reply.

The canary implements it (``CanaryStage`` over ``selection.CanaryRouter``) for a router
with a state table; ``NoCanary`` stands in for it in a router without one, where every
request goes as sent (``AsSent``), no backend is passed over and nothing is counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from spillway.canary.selection import CanaryRouter, Pick, version_missing
from spillway.policy.backend import BackendResponse
from spillway.policy.facts import Request
from spillway.protocol.replies import Reply

VERSION_NOT_SERVED = "version_not_served"
"""The outcome of an attempt a backend did not serve because it lacks the version the
router chose (passed over, or answered 404 ``model_not_found``)."""


class Tried(Protocol):
    """One attempt of a walk, as the stage reads it: how it ended and whether it served."""

    @property
    def outcome(self) -> str: ...

    @property
    def served(self) -> bool: ...


class Arm(Protocol):
    """The version one request is sent to, and what the walk asks about it."""

    @property
    def request(self) -> Request:
        """The request as the backends get it (with the chosen version, if any)."""
        ...

    def skips(self, backend: str) -> bool:
        """Whether the walk passes ``backend`` over (it does not serve the version)."""
        ...

    def unserved(self, backend: str, response: BackendResponse) -> bool:
        """Whether ``backend``'s answer says it does not serve the version: then it is no
        answer for the client, and the walk goes on."""
        ...

    def walk_again(self, attempts: Sequence[Tried]) -> Arm | None:
        """The arm to walk the chain again with after ``attempts`` served nothing (the
        stable version, when no backend served the chosen one); ``None``: the walk is over."""
        ...

    def settle(self, response: BackendResponse | None, latency_s: float, reply: Reply) -> Reply:
        """Record the answer (``None``: none came) and return the reply to send."""
        ...


class VersionStage(Protocol):
    """Gives each request its arm."""

    def pick(self, request: Request) -> Arm:
        """The request's arm; a request that may not be served raises its error."""
        ...


@dataclass(frozen=True)
class AsSent:
    """A request whose version nobody chooses: it goes as sent (pinned, or to the
    backends' default), and its answer is the client's whatever it says."""

    request: Request

    def skips(self, backend: str) -> bool:
        return False

    def unserved(self, backend: str, response: BackendResponse) -> bool:
        return False

    def walk_again(self, attempts: Sequence[Tried]) -> Arm | None:
        return None

    def settle(self, response: BackendResponse | None, latency_s: float, reply: Reply) -> Reply:
        return reply


class NoCanary:
    """The stage of a router without canaries (no state table): every request as sent."""

    def pick(self, request: Request) -> Arm:
        return AsSent(request)


NO_CANARY = NoCanary()


@dataclass(frozen=True)
class CanaryStage:
    """The canary's stage: versions chosen, and outcomes judged, by ``canaries``."""

    canaries: CanaryRouter

    def pick(self, request: Request) -> Arm:
        self.canaries.admit(request)
        pick = self.canaries.choose(request)
        if pick is None:
            return AsSent(request)
        return CanaryArm(self.canaries, pick, pick.pinned(request))


@dataclass(frozen=True)
class CanaryArm:
    """A request sent to the version the canary record chose for it (``pick``)."""

    canaries: CanaryRouter
    pick: Pick
    request: Request

    def skips(self, backend: str) -> bool:
        return self.canaries.skips(backend, self.pick)

    def unserved(self, backend: str, response: BackendResponse) -> bool:
        if not version_missing(response):
            return False
        self.canaries.missed(backend, self.pick)
        return True

    def walk_again(self, attempts: Sequence[Tried]) -> Arm | None:
        if any(a.served for a in attempts) or not any(
            a.outcome == VERSION_NOT_SERVED for a in attempts
        ):
            return None
        stable = self.canaries.to_stable(self.pick, [a.outcome for a in attempts])
        if stable is None:
            return None
        return CanaryArm(self.canaries, stable, stable.pinned(self.request))

    def settle(self, response: BackendResponse | None, latency_s: float, reply: Reply) -> Reply:
        return self.canaries.settle(self.pick, response, latency_s, reply)
