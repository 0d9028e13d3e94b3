"""ATC runs in a staging folder of the cache: a repository and a cache named relative to where geserve started
still compile (`make run` passes --model-repository=model_repository)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from geserve.offline import compile as compile_tool
from tests.fakes import atc as fake_atc
from tests.fakes.om_models import affine_onnx

CONFIG = """
name: "affine" backend: "ge" max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "s" data_type: TYPE_FP32 dims: [ 1 ] } ]
parameters { key: "atc_option.op_compiler_cache_dir" value { string_value: "op_cache" } }
"""


def test_a_relative_repository_and_cache_compile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "work" / "models" / "affine"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.onnx").write_bytes(affine_onnx())
    (folder / "config.pbtxt").write_text(CONFIG)
    atc = fake_atc.install(tmp_path / "bin")
    log = tmp_path / "atc-runs.jsonl"
    monkeypatch.setenv("PATH", f"{atc.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_ATC_LOG", str(log))
    monkeypatch.chdir(tmp_path / "work")
    status = compile_tool.main(
        ["--model-repository", "models", "--model-cache-dir", "cache", "--soc-version", "Ascend310P3"]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    assert "affine version 1: compiled: " in out, out
    [argv] = [line for line in log.read_text().splitlines() if line]
    paths = {flag: value for flag, _, value in (item.partition("=") for item in json.loads(argv)) if value}
    for flag in ("--model", "--output", "--op_compiler_cache_dir"):
        assert Path(paths[flag]).is_absolute(), (flag, paths[flag])
    assert Path(paths["--model"]) == (tmp_path / "work" / "models" / "affine" / "1" / "model.onnx")
    assert Path(paths["--op_compiler_cache_dir"]) == folder / "op_cache"  # the config's, inside its model folder
    assert list((tmp_path / "work" / "cache").glob("affine-*/model.om"))
