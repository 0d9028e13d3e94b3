"""Instance caps: each group, each model version (all its groups and devices) and the whole server, refused
before any instance starts, naming the cap."""

from __future__ import annotations

from pathlib import Path

import pytest

from geserve.core.service import InferenceService
from geserve.errors import GeserveError
from geserve.settings import ControlMode, RepositorySettings, ServerSettings, WorkerSettings
from geserve.workers import pool as pools_module
from geserve.workers.pool import InstancePools
from tests.support import write_identity_model


def _groups(*counts: int) -> str:
    groups = ", ".join(f'{{ name: "g{index}" kind: KIND_CPU count: {count} }}' for index, count in enumerate(counts))
    return f"instance_group [ {groups} ]"


async def _service(repository: Path) -> InferenceService:
    settings = RepositorySettings(paths=(repository,), control_mode=ControlMode.EXPLICIT, startup_models=())
    pools = InstancePools(WorkerSettings(process_workers=False))
    service = InferenceService(ServerSettings(), settings, pools)
    pools.caller = service
    assert await service.load_models() == {}
    return service


async def test_groups_that_together_pass_the_model_cap_are_refused(tmp_path: Path) -> None:
    write_identity_model(tmp_path, "wide", extra=_groups(40, 40))  # each group within its own cap of 64
    write_identity_model(tmp_path, "fits", extra=_groups(32, 32))
    service = await _service(tmp_path)
    try:
        with pytest.raises(GeserveError, match=r"asks for 80 instances in all .* limit is 64 instances per model"):
            await service.load_model("wide")
        await service.load_model("fits")
        assert service.model_version("fits").ready
    finally:
        await service.shutdown()


async def test_models_that_together_pass_the_server_cap_are_refused_until_one_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pools_module, "MAX_INSTANCES_PER_SERVER", 5)
    write_identity_model(tmp_path, "first", extra=_groups(2, 1))
    write_identity_model(tmp_path, "second", extra=_groups(3))
    service = await _service(tmp_path)
    try:
        await service.load_model("first")
        with pytest.raises(GeserveError, match=r"3 are running or starting and the server's limit is 5 instances"):
            await service.load_model("second")
        await service.unload_model("first")
        await service.load_model("second")
        assert service.model_version("second").ready
    finally:
        await service.shutdown()
