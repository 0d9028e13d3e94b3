"""EngineLink: the engine as a front door reaches it, in this process or over a protocol process's channel."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from typing import Any, Protocol

from geserve.frontdoor.responses import ClientRegions
from geserve.snapshots import ServedModel
from geserve.submissions import Answer, Submission


class EngineLink(Protocol):
    """What a front door asks of the engine: requests as submissions, and every other call of the InferenceAPI by
    name; and what it checks requests against: the served models and the client regions, the engine's own or the
    copies it pushes."""

    @property
    def models(self) -> Mapping[str, ServedModel]: ...

    @property
    def regions(self) -> ClientRegions: ...

    async def infer(self, submission: Submission) -> Answer:
        """The one response; errors carry the request's id."""
        ...

    def stream(self, submission: Submission) -> AsyncGenerator[Answer]:
        """Every response, the last one final; an error before the model answers is raised."""
        ...

    async def refresh(self) -> bool:
        """Bring the models and regions up to the engine's now (False: they are the engine's own, never behind).
        Asked where a request names something they lack: another process may have just loaded or registered it."""
        ...

    def refused(self, model_name: str, version: int) -> None:
        """A request refused by its checks here: a failure of the version's requests, which the engine counts."""
        ...

    async def call(self, method: str, *args: Any) -> Any:
        """Any other InferenceAPI method, answered by the engine."""
        ...
