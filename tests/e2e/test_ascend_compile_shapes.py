"""Configs written for Triton's GE backend (no max_batch_size, dims without the batch dim) on a `ge` model that
ships only model.onnx: compiled with the graph's batch dim by the stand-in `atc`, served on the pyACL simulator;
a config whose rank ATC would refuse fails to load before ATC runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.e2e.test_ascend import Launch
from tests.e2e.test_ascend_compile import Host
from tests.fakes.om_models import FEATURES, affine_onnx, affine_reference

pytestmark = [pytest.mark.e2e, pytest.mark.one_layout]

GE_STYLE = """
name: "{name}"
platform: "ge"
backend: "ge"
input [ {{ name: "x" data_type: TYPE_FP32 dims: [ {dims} ] }} ]
output [
  {{ name: "y" data_type: TYPE_FP32 dims: [ {features} ] }},
  {{ name: "s" data_type: TYPE_FP32 dims: [ 1 ] }}
]
instance_group [ {{ kind: KIND_GPU count: 1 }} ]
"""


def _model(host: Host, name: str, data: bytes, dims: str = str(FEATURES)) -> Path:
    folder = host.repository / name
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.onnx").write_bytes(data)
    (folder / "config.pbtxt").write_text(GE_STYLE.format(name=name, dims=dims, features=FEATURES))
    return folder / "1" / "model.onnx"


def _answers(client: httpclient.InferenceServerClient, model: str, rows: int) -> None:
    x = np.random.default_rng(rows).normal(size=(rows, FEATURES)).astype(np.float32)
    tensor = httpclient.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    result = client.infer(model, [tensor])
    reference = affine_reference(x)
    for name in ("y", "s"):
        np.testing.assert_allclose(result.as_numpy(name), reference[name], rtol=1e-6)


def test_a_ge_style_config_compiles_with_the_graphs_batch_dim_and_serves(launch: Launch, tmp_path: Path) -> None:
    host = Host(tmp_path)
    open_batch = _model(host, "open", affine_onnx())  # x: [batch, 4]
    _model(host, "fixed", affine_onnx(batch=2))  # x: [2, 4]
    _model(host, "deep", affine_onnx(), dims="2, 2, 1")  # rank 3 for [batch, 4]: ATC refuses it
    server = host.start(launch, "--device-ids=0")
    client = httpclient.InferenceServerClient(server.url)
    [argv] = host.runs("open")
    assert f"--input_shape=x:1,{FEATURES}" in argv
    [argv] = host.runs("fixed")
    assert f"--input_shape=x:2,{FEATURES}" in argv
    log = server.log()
    assert (
        f"model 'open': config input 'x' has dims [{FEATURES}] and no max_batch_size, one dim short of input 'x' of "
        f"'{open_batch}' (shape [-1, {FEATURES}]): ATC compiles it as --input_shape=x:1,{FEATURES}, a batch of 1"
    ) in log
    # Served as a shipped .om of the compiled shape: the .om's batch dim completes max_batch_size.
    assert client.get_model_config("open")["max_batch_size"] == 1
    _answers(client, "open", 1)
    assert client.get_model_config("fixed")["max_batch_size"] == 2
    _answers(client, "fixed", 1)
    _answers(client, "fixed", 2)
    assert not client.is_model_ready("deep") and host.runs("deep") == []
    [entry] = [m for m in client.get_model_repository_index() if m["name"] == "deep"]
    assert (
        "model 'deep': config input 'x' gives ATC --input_shape=x:2,2,1 (dims [2, 2, 1]), 3 dims, but input 'x' of "
        f"'{host.repository / 'deep' / '1' / 'model.onnx'}' has shape [-1, {FEATURES}], 2 dims; ATC refuses an input "
        "shape whose rank is not the graph's"
    ) in entry["reason"]
    assert server.stop() == 0
