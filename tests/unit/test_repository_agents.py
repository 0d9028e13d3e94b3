"""model_repository_agents: Triton's checksum agent checks MD5 digests before a load; other agents are refused."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from geserve._generated import model_config_pb2 as mc
from geserve.errors import ModelLoadError
from geserve.repository.agents import run_agents

CONTENT = b"weights"
DIGEST = hashlib.md5(CONTENT).hexdigest()


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "m"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.onnx").write_bytes(CONTENT)
    (tmp_path / "secret").write_bytes(b"outside")
    return folder


def _config(name: str = "checksum", **parameters: str) -> mc.ModelConfig:
    config = mc.ModelConfig(name="m")
    agent = config.model_repository_agents.agents.add(name=name)
    for key, value in parameters.items():
        agent.parameters[key] = value
    return config


def _refusal(model_dir: Path, config: mc.ModelConfig) -> str:
    with pytest.raises(ModelLoadError) as error:
        run_agents(config, model_dir)
    return error.value.message


def test_matching_digests_pass(model_dir: Path) -> None:
    run_agents(_config(**{"MD5:1/model.onnx": DIGEST}), model_dir)
    run_agents(_config(**{"md5:1/model.onnx": DIGEST}), model_dir)  # the algorithm is matched case-insensitively
    run_agents(mc.ModelConfig(name="m"), model_dir)


def test_mismatch_fails_with_the_agents_text(model_dir: Path) -> None:
    wrong = "0" * 32
    assert _refusal(model_dir, _config(**{"MD5:1/model.onnx": wrong})) == (
        f"model 'm': Mismatched MD5 hash for file 1/model.onnx, expect: {wrong}, got: {DIGEST}"
    )


def test_every_listed_file_is_checked(model_dir: Path) -> None:
    (model_dir / "labels.txt").write_text("a\n")
    config = _config(**{"MD5:1/model.onnx": DIGEST, "MD5:labels.txt": DIGEST})
    assert "Mismatched MD5 hash for file labels.txt" in _refusal(model_dir, config)


@pytest.mark.parametrize(
    ("key", "text"),
    [
        ("MD5:1/missing.onnx", "failed to open text file for read 1/missing.onnx: No such file or directory"),
        ("SHA1:1/model.onnx", "Unsupported checksum algorithm: SHA1"),
        ("1/model.onnx", "failed to parse key: 1/model.onnx"),
        ("MD5:../secret", "checksum file ../secret is outside the model folder"),
        ("MD5:1/../../secret", "checksum file 1/../../secret is outside the model folder"),
        ("MD5:/etc/hostname", "checksum file /etc/hostname is outside the model folder"),
    ],
)
def test_bad_entries_fail_the_load(model_dir: Path, key: str, text: str) -> None:
    assert _refusal(model_dir, _config(**{key: DIGEST})) == f"model 'm': {text}"


def test_a_link_the_repository_placed_is_followed_as_by_triton(model_dir: Path, tmp_path: Path) -> None:
    # A common layout: the version folder links to weights kept elsewhere.
    weights = tmp_path / "weights.onnx"
    weights.write_bytes(CONTENT)
    (model_dir / "1" / "linked.onnx").symlink_to(weights)
    run_agents(_config(**{"MD5:1/linked.onnx": DIGEST}), model_dir)


def test_other_agents_are_refused(model_dir: Path) -> None:
    assert _refusal(model_dir, _config("relocation")) == (
        "model 'm': repository agent 'relocation' is not available in geserve, which runs only the built-in "
        "'checksum' agent"
    )
