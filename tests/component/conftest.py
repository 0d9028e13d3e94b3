"""Fixtures of the component tests: the pyACL simulator, importable as `acl` for one test, and an
InferenceService in process on thread instances."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from geserve.core.service import InferenceService
from geserve.settings import ControlMode, MetricsSettings, RepositorySettings, ServerSettings, WorkerSettings
from geserve.workers.pool import InstancePools
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


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[InferenceService]:
    """`echo` (identity, FP32 [-1], batching) and the shipped `simple` (ONNX, INT32 add/sub), in process."""
    write_identity_model(tmp_path, "echo")
    copy_model("simple", tmp_path)
    served = await in_process_service(tmp_path, summary_latencies=True, histogram_latencies=True)
    yield served
    await served.shutdown()
