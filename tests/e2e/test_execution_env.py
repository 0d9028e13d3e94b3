"""EXECUTION_ENV_PATH: a python model runs with its own environment's interpreter and packages, through tritonclient."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support import GeserveProcess, config_text, write_identity_model, write_python_model

pytestmark = [pytest.mark.e2e, pytest.mark.one_layout]

MARKER = "only in the execution environment"
SERVER_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"

MODEL_PY = """
import json
import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        import env_marker  # only the environment's site-packages has it

        info = {
            "marker": env_marker.VALUE,
            "executable": sys.executable,
            "prefix": sys.prefix,
            "library_path": os.environ.get("LD_LIBRARY_PATH"),
            "no_user_site": sys.flags.no_user_site,
        }
        out = pb_utils.Tensor("INFO", np.array([json.dumps(info).encode()], dtype=np.object_))
        return [pb_utils.InferenceResponse([out]) for _ in requests]
"""


def _write_model(repository: Path, name: str, path: str) -> Path:
    config = config_text(
        name,
        backend="python",
        inputs=[("IN", "TYPE_INT32", "1")],
        outputs=[("INFO", "TYPE_STRING", "1")],
        extra=f'parameters {{ key: "EXECUTION_ENV_PATH" value {{ string_value: "{path}" }} }}',
    )
    return write_python_model(repository, name, MODEL_PY, config)


def _numpy_only(root: Path) -> Path:
    """A folder that holds only the test interpreter's numpy, as an environment's own numpy would be."""
    folder = root / "numpy-only"
    folder.mkdir()
    site = Path(np.__file__).parent.parent
    for entry in site.iterdir():
        if entry.name.startswith("numpy"):
            (folder / entry.name).symlink_to(entry)
    return folder


def _build_environment(root: Path) -> Path:
    """A relocatable environment as conda-pack makes one: this Python (copied, not linked to), the marker module in
    its site-packages, numpy through a .pth; no pip."""
    env = root / "env"
    subprocess.run([sys.executable, "-m", "venv", "--copies", "--without-pip", str(env)], check=True)
    for name in ("python", "python3"):  # relative links, as conda-pack keeps them
        (env / "bin" / name).unlink()
        (env / "bin" / name).symlink_to(f"python{SERVER_PYTHON}")
    site = env / "lib" / f"python{SERVER_PYTHON}" / "site-packages"
    (site / "env_marker.py").write_text(f"VALUE = {MARKER!r}\n")
    (site / "numpy_only.pth").write_text(f"{_numpy_only(root)}\n")
    return env


def _tar(source: Path, archive: Path) -> Path:
    with tarfile.open(archive, "w:gz") as tar:  # links stay links (conda-pack's archives keep them)
        for entry in sorted(source.iterdir()):
            tar.add(entry, arcname=entry.name)
    return archive


def _other_python_environment(root: Path) -> Path:
    """An environment built for another Python: its lib/python3.X says so."""
    env = root / "other"
    (env / "bin").mkdir(parents=True)
    (env / "lib" / "python3.7" / "site-packages").mkdir(parents=True)
    (env / "bin" / "python3").symlink_to("python3.7")
    (env / "bin" / "python3.7").write_text("#!/bin/sh\necho 'Python 3.7.17'\n")
    (env / "bin" / "python3.7").chmod(0o755)
    return env


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeserveProcess]:
    root = tmp_path_factory.mktemp("execution_env")
    repository = root / "models"
    env = _build_environment(root)
    packed = _tar(env, root / "env.tar.gz")
    packed_model = _write_model(repository, "packed", "$$TRITON_MODEL_DIRECTORY/env.tar.gz")
    os.replace(packed, packed_model / "env.tar.gz")
    _write_model(repository, "unpacked", str(env))
    other = _tar(_other_python_environment(root), root / "other.tar.gz")
    _write_model(repository, "other_python", str(other))
    _write_model(repository, "missing", "$$TRITON_MODEL_DIRECTORY/env.tar.gz")
    write_identity_model(repository, "echo", max_batch_size=0)
    process = GeserveProcess(
        root / "geserve.log",
        f"--model-repository={repository}",
        "--model-control-mode=explicit",
        "--load-model=echo",
        env={"XDG_CACHE_HOME": str(root / "cache"), "LD_LIBRARY_PATH": "/server/lib"},
    ).wait_live()
    yield process
    assert process.stop() == 0, process.log()


def _cache(server: GeserveProcess) -> Path:
    return server.log_path.parent / "cache" / "geserve" / "execution-envs"


def _info(server: GeserveProcess, model: str) -> dict[str, str]:
    tensor = httpclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([1], dtype=np.int32))
    result = httpclient.InferenceServerClient(server.url).infer(model, [tensor])
    info: dict[str, str] = json.loads(result.as_numpy("INFO")[0])
    return info


def _echo_answers(server: GeserveProcess) -> None:
    tensor = grpcclient.InferInput("INPUT0", [2], "FP32")
    tensor.set_data_from_numpy(np.array([1.0, 2.0], dtype=np.float32))
    result = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}").infer("echo", [tensor])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [1.0, 2.0])


def _load_error(server: GeserveProcess, model: str) -> str:
    with pytest.raises(InferenceServerException) as raised:
        httpclient.InferenceServerClient(server.url).load_model(model)
    return str(raised.value.message())


def test_a_packed_environment_is_unpacked_once_and_runs_the_model(server: GeserveProcess) -> None:
    client = httpclient.InferenceServerClient(server.url)
    client.load_model("packed")
    info = _info(server, "packed")
    assert info["marker"] == MARKER
    unpacked = [path for path in _cache(server).iterdir() if path.is_dir() and len(path.name) == 64]
    assert len(unpacked) == 1
    assert info["executable"] == str(unpacked[0] / "bin" / "python3")
    assert info["prefix"] == str(unpacked[0])
    assert info["executable"] != sys.executable
    assert info["library_path"].split(os.pathsep)[0] == str(unpacked[0] / "lib")
    # Loaded again (another instance process), the same unpacked environment serves it.
    client.load_model("packed")
    assert _info(server, "packed")["executable"] == info["executable"]
    assert [path for path in _cache(server).iterdir() if path.is_dir() and len(path.name) == 64] == unpacked
    _echo_answers(server)


def test_a_directory_environment_is_used_in_place(server: GeserveProcess) -> None:
    httpclient.InferenceServerClient(server.url).load_model("unpacked")
    info = _info(server, "unpacked")
    env = server.log_path.parent / "env"
    assert info == {
        "marker": MARKER,
        "executable": str(env / "bin" / "python3"),
        "prefix": str(env),
        # The environment's libraries first, the server's after; the server's user site-packages stay out.
        "library_path": f"{env / 'lib'}{os.pathsep}/server/lib",
        "no_user_site": 1,
    }


def test_an_environment_of_another_python_is_refused(server: GeserveProcess) -> None:
    message = _load_error(server, "other_python")
    assert "is Python 3.7" in message and f"geserve runs Python {SERVER_PYTHON}" in message, message
    assert "must match" in message
    assert not httpclient.InferenceServerClient(server.url).is_model_ready("other_python")
    _echo_answers(server)


def test_a_missing_environment_is_refused(server: GeserveProcess) -> None:
    message = _load_error(server, "missing")
    missing = server.log_path.parent / "models" / "missing" / "env.tar.gz"
    assert f"Failed to get the canonical path for {missing}." in message, message
    _echo_answers(server)
