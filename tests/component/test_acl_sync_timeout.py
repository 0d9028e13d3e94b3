"""A hung NPU: the batch's synchronize gives up after sync_timeout_ms and fails as a device fault."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from geserve._generated import model_config_pb2 as mc
from geserve.backends.acl import AclBackend
from geserve.backends.acl.runtime import Acl
from geserve.backends.base import DeviceFaultError
from geserve.errors import ModelLoadError
from tests.fakes.om_models import FEATURES, affine_reference, write_affine_om

GEARS = [1, 2, 4]


def _config(timeout: str | None) -> mc.ModelConfig:
    config = mc.ModelConfig(name="affine")
    if timeout is not None:
        config.parameters["sync_timeout_ms"].string_value = timeout
    return config


def _loaded(path: Path, timeout: str | None) -> AclBackend:
    backend = AclBackend()
    config = _config(timeout)
    backend.load(config, path, 0)
    backend.complete_config(config, auto_complete=True)
    return backend


def _rows(count: int) -> np.ndarray:
    return np.arange(count * FEATURES, dtype=np.float32).reshape(count, FEATURES)


@pytest.mark.usefixtures("acl")
@pytest.mark.parametrize(
    ("code", "name"),
    [("", "507046 (ACL_ERROR_RT_STREAM_SYNC_TIMEOUT)"), ("107020", "107020 (ACL_ERROR_RT_TASK_TIMEOUT)")],
)
def test_a_hung_execution_fails_after_the_timeout_as_a_device_fault(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: str, name: str
) -> None:
    hang = tmp_path / "hang"
    monkeypatch.setenv("ACL_SIM_HANG_FILE", str(hang))
    backend = _loaded(write_affine_om(tmp_path / "model.om", gears=GEARS), "300")
    np.testing.assert_array_equal(backend.execute({"x": _rows(2)}, ["y"])["y"], affine_reference(_rows(2))["y"])
    hang.write_text(code)
    started = time.monotonic()
    with pytest.raises(DeviceFaultError) as error:
        backend.execute({"x": _rows(3)}, ["y"])
    assert 0.3 <= time.monotonic() - started < 5
    assert error.value.message == (
        "model 'affine': the NPU did not finish the batch within 300 ms (parameter 'sync_timeout_ms'): "
        f"acl.rt.synchronize_stream_with_timeout failed with error {name}: "
        f"EE{int(name[:6]) % 10000:04d}: stream {backend._stream:#x} did not finish within the timeout; "
        "the instance restarts"
    )
    backend.unload()  # returns, though the work never ends: the retiring process leaves it to its exit


@pytest.mark.usefixtures("acl")
def test_without_the_parameter_the_timeout_is_a_minute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from acl import rt

    waited: list[int] = []
    synchronize = rt.synchronize_stream_with_timeout
    monkeypatch.setattr(rt, "synchronize_stream_with_timeout", lambda s, ms: waited.append(ms) or synchronize(s, ms))
    backend = _loaded(write_affine_om(tmp_path / "model.om", gears=GEARS), None)
    backend.execute({"x": _rows(1)}, ["y"])
    backend.unload()
    assert waited == [60000]
    backend = _loaded(write_affine_om(tmp_path / "model.om", gears=GEARS), "-1")  # the runtime's "forever"
    backend.execute({"x": _rows(1)}, ["y"])
    backend.unload()
    assert waited == [60000, -1]


@pytest.mark.usefixtures("acl")
@pytest.mark.parametrize("value", ["0", "-2", "1.5", "soon", "2147483648"])
def test_a_bad_timeout_fails_the_load_naming_the_parameter(tmp_path: Path, value: str) -> None:
    with pytest.raises(ModelLoadError) as error:
        _loaded(write_affine_om(tmp_path / "model.om", gears=GEARS), value)
    assert error.value.message == (
        "model 'affine': parameter 'sync_timeout_ms' must be a whole number of milliseconds from 1 to 2147483647, "
        f"or -1 to wait without a limit; got '{value}'"
    )


def test_the_simulated_wait_runs_out_with_the_runtimes_code_and_takes_the_timeouts_it_takes(
    acl: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aclrtSynchronizeStreamWithTimeout returns ACL_ERROR_RT_STREAM_SYNC_TIMEOUT (507046) when the wait runs out,
    and refuses a timeout below -1 with ACL_ERROR_RT_PARAM_INVALID (hicann/runtime aclrt_impl/stream.cpp)."""
    hang = tmp_path / "hang"
    monkeypatch.setenv("ACL_SIM_HANG_FILE", str(hang))
    backend = _loaded(write_affine_om(tmp_path / "model.om", gears=GEARS), "100")
    hang.write_text("")
    staged = backend.stage({"x": _rows(1)})
    backend.launch(staged)
    assert acl.rt.synchronize_stream_with_timeout(backend._stream, 50) == 507046
    assert acl.rt.synchronize_stream_with_timeout(backend._stream, -2) == 107000
    assert "[-1, INT_MAX]" in acl.get_recent_err_msg()
    backend.unload()


@pytest.mark.parametrize("code", [107019, 107020, 507046])
def test_every_synchronize_timeout_code_is_a_device_fault(acl: object, code: int) -> None:
    assert isinstance(Acl(acl, "m").error("acl.rt.synchronize_stream_with_timeout", code), DeviceFaultError)
