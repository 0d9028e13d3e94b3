"""LocalEngineLink: the engine in this process as a front door reaches it, with nothing copied or pickled."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Mapping
from typing import Any

from geserve.core.models import Model
from geserve.core.service import InferenceService
from geserve.core.shared_memory import SharedMemoryManager
from geserve.errors import GeserveError
from geserve.submissions import Answer, Submission


class LocalEngineLink:
    """One process serves everything: the front door checks requests against the engine's own models and regions,
    and its submissions and calls are the engine's methods, awaited on the same loop."""

    def __init__(self, service: InferenceService) -> None:
        self._service = service

    @property
    def models(self) -> Mapping[str, Model]:
        return self._service.models

    @property
    def regions(self) -> SharedMemoryManager:
        return self._service.shared_memory

    async def infer(self, submission: Submission) -> Answer:
        answered: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()

        def done(outcome: Answer | GeserveError) -> None:
            if answered.done():
                return
            if isinstance(outcome, GeserveError):
                answered.set_exception(outcome)
            else:
                answered.set_result(outcome)

        cancel = self._service.submit(submission, done)
        try:
            return await answered
        except asyncio.CancelledError:
            cancel()  # the client went away
            raise

    def stream(self, submission: Submission) -> AsyncGenerator[Answer]:
        return self._service.stream_submission(submission)

    async def refresh(self) -> bool:
        return False  # the engine's own models and regions: never behind

    def refused(self, model_name: str, version: int) -> None:
        self._service.refused(model_name, version)

    async def call(self, method: str, *args: Any) -> Any:
        return await getattr(self._service, method)(*args)
