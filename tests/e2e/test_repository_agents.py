"""model_repository_agents through a real server: the checksum agent guards loads; other agents are refused."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support import GeserveProcess, copy_model

pytestmark = [pytest.mark.e2e, pytest.mark.one_layout]

AGENT = 'model_repository_agents {{ agents {{ name: "{name}" parameters {{ key: "MD5:1/model.onnx" value: "{digest}" }} }} }}'
WRONG = "0" * 32


def _with_agent(repository: Path, model: str, name: str, digest: str | None = None) -> str:
    folder = copy_model("simple", repository, model)
    config = folder / "config.pbtxt"
    actual = hashlib.md5((folder / "1" / "model.onnx").read_bytes()).hexdigest()
    text = config.read_text().replace('name: "simple"', f'name: "{model}"')
    config.write_text(text + AGENT.format(name=name, digest=digest or actual))
    return actual


@pytest.fixture(scope="module")
def agents_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeserveProcess]:
    root = tmp_path_factory.mktemp("agents")
    repository = root / "models"
    _with_agent(repository, "checked", "checksum")
    _with_agent(repository, "tampered", "checksum", WRONG)
    _with_agent(repository, "relocated", "relocation")
    process = GeserveProcess(
        root / "geserve.log",
        f"--model-repository={repository}",
        "--model-control-mode=explicit",
        "--load-model=checked",
    ).wait_live()
    yield process
    assert process.stop() == 0, process.log()


def _infer(client: httpclient.InferenceServerClient, model: str) -> None:
    data = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [httpclient.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(data)
    np.testing.assert_array_equal(client.infer(model, inputs).as_numpy("OUTPUT0"), data * 2)


def test_matching_checksum_loads_and_serves(agents_server: GeserveProcess) -> None:
    http = httpclient.InferenceServerClient(agents_server.url)
    assert http.is_model_ready("checked")
    _infer(http, "checked")


def test_mismatched_checksum_refuses_the_load_and_the_server_keeps_serving(agents_server: GeserveProcess) -> None:
    http = httpclient.InferenceServerClient(agents_server.url)
    digest = hashlib.md5((agents_server.log_path.parent / "models" / "tampered" / "1" / "model.onnx").read_bytes())
    with pytest.raises(InferenceServerException) as error:
        http.load_model("tampered")
    expected = f"Mismatched MD5 hash for file 1/model.onnx, expect: {WRONG}, got: {digest.hexdigest()}"
    assert "failed to load 'tampered'" in error.value.message() and expected in error.value.message()
    assert not http.is_model_ready("tampered")
    _infer(http, "checked")


def test_other_agents_are_refused_naming_the_agent(agents_server: GeserveProcess) -> None:
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{agents_server.grpc_port}")
    with pytest.raises(InferenceServerException) as error:
        grpc.load_model("relocated")
    assert "repository agent 'relocation' is not available in geserve" in error.value.message()
    assert not grpc.is_model_ready("relocated")
    _infer(httpclient.InferenceServerClient(agents_server.url), "checked")
