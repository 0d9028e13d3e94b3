"""The Ascend backend in this process against the pyACL simulator: static and dynamic AIPP, and the SoC check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from geserve._generated import model_config_pb2 as mc
from geserve.backends.acl import AclBackend
from geserve.errors import ModelLoadError
from tests.fakes.om_models import aipp_description, dynamic_aipp_description, write_affine_om
from tests.fakes.om_writer import write_om


def _runtime() -> Any:
    from acl._state import RUNTIME

    return RUNTIME


def test_the_simulator_reports_the_image_dims_and_the_buffer_dims_apart(acl: Any, tmp_path: Path) -> None:
    path = write_om(tmp_path / "aipp.om", aipp_description(height=16, width=16))
    assert acl.init() == 0 and acl.rt.set_device(0) == 0
    _context, ret = acl.rt.create_context(0)
    model_id, ret = acl.mdl.load_from_file(str(path))
    assert ret == 0
    desc = acl.mdl.create_desc()
    assert acl.mdl.get_desc(desc, model_id) == 0
    assert acl.mdl.get_input_dims(desc, 0)[0]["dims"] == [1, 16, 16, 3]
    assert acl.mdl.get_input_dims_v2(desc, 0)[0]["dims"] == [1, 24, 16, 1]
    assert acl.mdl.get_input_size_by_index(desc, 0) == 24 * 16


@pytest.mark.usefixtures("acl")
def test_a_static_aipp_model_serves_the_dims_of_its_buffer(tmp_path: Path) -> None:
    backend = AclBackend()
    config = mc.ModelConfig(name="aipp")
    backend.load(config, write_om(tmp_path / "aipp.om", aipp_description(height=16, width=16)), 0)
    backend.complete_config(config, auto_complete=True)
    assert config.max_batch_size == 1
    assert config.input[0].data_type == mc.TYPE_UINT8 and list(config.input[0].dims) == [24, 16, 1]
    image = np.arange(24 * 16, dtype=np.uint8).reshape(1, 24, 16, 1)
    prob = backend.execute({"image": image}, ["prob"])["prob"]
    # Without an ONNX twin the simulator fills each output row with its input row's sum.
    np.testing.assert_array_equal(prob, np.full((1, 10), float(image.sum()), dtype=np.float32))
    assert "mdl.get_input_dims_v2" in _runtime().calls
    backend.unload()
    assert _runtime().leaks() == []


@pytest.mark.usefixtures("acl")
def test_a_dynamic_aipp_model_is_refused_at_load(tmp_path: Path) -> None:
    backend = AclBackend()
    path = write_om(tmp_path / "dyn.om", dynamic_aipp_description())
    with pytest.raises(ModelLoadError) as error:
        backend.load(mc.ModelConfig(name="dyn"), path, 0)
    assert "dynamic AIPP is not supported" in error.value.message and str(path) in error.value.message
    assert _runtime().leaks() == []


@pytest.mark.usefixtures("acl")
def test_a_model_for_another_soc_is_refused_before_the_runtime_loads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_affine_om(tmp_path / "model.om", static_batch=1)  # compiled for Ascend310P3
    monkeypatch.setenv("ACL_SIM_SOC_NAME", "Ascend910B3")
    with pytest.raises(ModelLoadError) as error:
        AclBackend().load(mc.ModelConfig(name="affine"), path, 0)
    assert "was compiled for Ascend310P3, this host is Ascend910B3" in error.value.message
    assert "mdl.load_from_file" not in _runtime().calls
    assert _runtime().leaks() == []
    monkeypatch.setenv("ACL_SIM_SOC_NAME", "Ascend310P3")
    backend = AclBackend()
    backend.load(mc.ModelConfig(name="affine"), path, 0)
    backend.unload()
