"""Fixtures of the component tests: the pyACL simulator, importable as `acl` for one test, and an
InferenceService in process on thread instances, with the FrontDoor the front-ends call in front of it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from geserve.core.local_link import LocalEngineLink
from geserve.core.service import InferenceService
from geserve.frontdoor.arena import RequestArena, request_arena
from geserve.frontdoor.placement import Placement
from geserve.frontdoor.service import FrontDoor
from geserve.settings import ControlMode, MetricsSettings, RepositorySettings, ServerSettings, WorkerSettings
from geserve.workers.pool import InstancePools
from geserve.workers.runs import RunId
from geserve.workers.shm import REQUEST_ARENA_ROLE
from tests.support import copy_model, write_identity_model

FAKES = Path(__file__).resolve().parents[1] / "fakes"


@pytest.fixture
def acl(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The simulator, importable as `acl` for this test only, in a fresh state."""
    monkeypatch.syspath_prepend(str(FAKES))
    for name in (
        "ACL_SIM_RUN_MODE",
        "ACL_SIM_FAULT_FILE",
        "ACL_SIM_REPORT_DIR",
        "ACL_SIM_SOC_NAME",
        "ASCEND_RT_VISIBLE_DEVICES",
    ):
        monkeypatch.delenv(name, raising=False)
    import acl as simulator
    from acl._state import RUNTIME

    RUNTIME.reset()
    yield simulator
    RUNTIME.reset()


async def in_process_service(
    repository: Path, server: ServerSettings | None = None, **metrics: bool
) -> InferenceService:
    """The models of `repository`, loaded and served on threads of this process (no server, no socket)."""
    settings = RepositorySettings(paths=(repository,), control_mode=ControlMode.EXPLICIT, startup_models=("*",))
    pools = InstancePools(WorkerSettings(process_workers=False))
    service = InferenceService(server or ServerSettings(), settings, pools, metrics=MetricsSettings(**metrics))
    pools.caller = service
    assert await service.load_models() == {}
    return service


@dataclass
class InProcess:
    """An engine in this process and the front door in front of it, wired as geserve.server wires them: `door` is
    the InferenceAPI the front-ends call."""

    engine: InferenceService
    door: FrontDoor
    arena: RequestArena | None

    async def shutdown(self) -> None:
        try:
            await self.engine.shutdown()
        finally:
            if self.arena is not None:
                self.arena.close()


async def in_process_server(repository: Path, server: ServerSettings | None = None, **metrics: bool) -> InProcess:
    """`in_process_service` with a FrontDoor over a LocalEngineLink in front of it, placing inputs in a request
    arena of this run (as one server process does)."""
    server = server or ServerSettings()
    engine = await in_process_service(repository, server, **metrics)
    run = RunId.current()
    arena = request_arena(run.segment_name(f"{REQUEST_ARENA_ROLE}0"), server.request_arena_bytes)
    door = FrontDoor(LocalEngineLink(engine), Placement(arena, run), server.max_bytes_elements)
    return InProcess(engine, door, arena)


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[FrontDoor]:
    """`echo` (identity, FP32 [-1], batching) and the shipped `simple` (ONNX, INT32 add/sub), in process, served
    through the front door."""
    write_identity_model(tmp_path, "echo")
    copy_model("simple", tmp_path)
    served = await in_process_server(tmp_path, summary_latencies=True, histogram_latencies=True)
    yield served.door
    await served.shutdown()
