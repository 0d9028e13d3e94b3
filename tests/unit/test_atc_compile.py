"""Compiling `ge` models from ONNX: the ATC command a config gives, option checks, the cache key, CANN's version,
which runtime serves a version, and the stand-in atc's own checks."""

from __future__ import annotations

import os
import platform
import re
import time
from dataclasses import replace
from pathlib import Path

import pytest
from google.protobuf import text_format

from geserve._generated import model_config_pb2 as mc
from geserve.atc import cache, command, compiler, graph_inputs, host, options
from geserve.backends import registry
from geserve.errors import ModelLoadError
from geserve.repository.scan import ModelSource
from geserve.settings import WorkerSettings
from geserve.workers.npu_mode import FALLBACK_PARAMETER, NpuResolver
from tests.fakes import atc as fake_atc
from tests.fakes.om_models import affine_onnx


def _config(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


AFFINE = """
name: "affine" backend: "ge" max_batch_size: 16
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
dynamic_batching { preferred_batch_size: [ 8, 4, 8 ] }
"""


def test_gears_are_1_the_preferred_sizes_and_the_max_sorted_and_unique() -> None:
    assert command.gears(_config(AFFINE)) == [1, 4, 8, 16]
    assert command.gears(_config('name: "m" max_batch_size: 4')) == [1, 4]
    assert command.gears(_config('name: "m" max_batch_size: 0')) == []


def test_preferred_sizes_above_the_max_are_refused() -> None:
    with pytest.raises(ModelLoadError, match=r"preferred_batch_size \[32\]"):
        command.gears(_config('name: "m" max_batch_size: 8 dynamic_batching { preferred_batch_size: [ 32 ] }'))


def test_the_command_carries_shapes_gears_chip_and_options() -> None:
    built = command.build(_config(AFFINE), "Ascend310P3", [options.AtcOption("output_type", "FP32")])
    assert built.arguments == (
        "--input_shape=x:-1,4",
        "--dynamic_batch_size=1,4,8,16",
        "--soc_version=Ascend310P3",
        "--output_type=FP32",
    )
    argv = built.argv("atc", Path("m.onnx"), Path("out/model"))
    assert argv[:4] == ["atc", "--framework=5", "--model=m.onnx", "--output=out/model"]


def test_a_model_whose_only_gear_is_1_and_one_without_batching_compile_static() -> None:
    single = command.build(_config('name: "m" max_batch_size: 1 input [ { name: "a" dims: [ 2, 3 ] } ]'), "S", [])
    assert single.arguments == ("--input_shape=a:1,2,3", "--soc_version=S")
    unbatched = command.build(
        _config('name: "m" input [ { name: "a" dims: [ 2 ] }, { name: "b" dims: [ 5, 6 ] format: FORMAT_NCHW } ]'),
        "S",
        [],
    )
    assert unbatched.arguments == ("--input_shape=a:2;b:5,6", "--soc_version=S", "--input_format=NCHW")


def test_variable_dims_and_missing_inputs_are_refused_by_name() -> None:
    with pytest.raises(ModelLoadError, match=r"input 'x' has variable dims \[-1\]"):
        command.build(_config('name: "m" max_batch_size: 2 input [ { name: "x" dims: [ -1 ] } ]'), "S", [])
    with pytest.raises(ModelLoadError, match="needs its inputs"):
        command.build(_config('name: "m" max_batch_size: 2'), "S", [])


def test_options_geserve_sets_conflicting_gears_and_unknown_flags_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as caught:
        options.parse(
            {
                "atc_option.soc_version": "Ascend910B",
                "atc_option.dynamic_dims": "1;2",
                "atc_option.fast_please": "1",
                "atc_option.log": "error",
            },
            "m",
            tmp_path,
        )
    message = caught.value.message
    assert "atc_option.soc_version set ATC flags geserve derives" in message
    assert "atc_option.dynamic_dims ask for gears" in message
    assert "atc_option.fast_please name no ATC flag" in message
    assert "atc_option.log" not in message


def test_file_options_resolve_inside_the_model_folder(tmp_path: Path) -> None:
    (tmp_path / "aipp.cfg").write_text("aipp_op {}")
    [option] = options.parse({"atc_option.insert_op_conf": "aipp.cfg"}, "m", tmp_path)
    assert option.file == (tmp_path / "aipp.cfg").resolve() and option.value == str(option.file)
    with pytest.raises(ModelLoadError, match="names no file inside the model folder"):
        options.parse({"atc_option.insert_op_conf": "../outside.cfg"}, "m", tmp_path)


def test_the_cache_key_follows_onnx_options_option_files_chip_and_cann(tmp_path: Path) -> None:
    onnx = tmp_path / "model.onnx"
    onnx.write_bytes(affine_onnx())
    aipp = tmp_path / "aipp.cfg"
    aipp.write_text("one")
    built = command.build(
        _config(AFFINE), "Ascend310P3", options.parse({"atc_option.insert_op_conf": "aipp.cfg"}, "m", tmp_path)
    )
    first = cache.key(onnx, built, "Ascend310P3", "8.0.RC1")
    assert cache.key(onnx, built, "Ascend310P3", "8.0.RC1") == first
    assert cache.key(onnx, built, "Ascend910B3", "8.0.RC1") != first
    assert cache.key(onnx, built, "Ascend310P3", "8.0.RC2") != first
    other = command.build(_config(AFFINE), "Ascend310P3", [])
    assert cache.key(onnx, other, "Ascend310P3", "8.0.RC1") != first
    aipp.write_text("two")
    assert cache.key(onnx, built, "Ascend310P3", "8.0.RC1") != first
    aipp.write_text("one")
    onnx.write_bytes(affine_onnx(features=5))
    assert cache.key(onnx, built, "Ascend310P3", "8.0.RC1") != first


def test_publishing_an_entry_another_server_published_keeps_theirs(tmp_path: Path) -> None:
    folder = tmp_path / "m-key"
    first, second = cache.staging(tmp_path, 60), cache.staging(tmp_path, 60)
    (first / "model.om").write_bytes(b"first")
    (second / "model.om").write_bytes(b"second")
    assert cache.publish(first, folder).read_bytes() == b"first"
    assert cache.publish(second, folder).read_bytes() == b"first"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["m-key"]


def test_the_cann_version_is_read_where_the_installer_records_it(tmp_path: Path) -> None:
    fake_atc.install_cann(tmp_path / "toolkit", "8.0.RC3")
    assert host.cann_version({"ASCEND_HOME_PATH": str(tmp_path / "toolkit")}) == "8.0.RC3"
    compiler_only = tmp_path / "nnae" / "compiler" / "version.info"
    compiler_only.parent.mkdir(parents=True)
    compiler_only.write_text("Version=7.0.0\n")
    assert host.cann_version({"ASCEND_TOOLKIT_HOME": str(tmp_path / "nnae")}) == "7.0.0"
    assert host.cann_version({}) == "unknown"
    assert platform.machine()  # the installer's folder is named by it


def _ge_model(tmp_path: Path, files: tuple[str, ...]) -> tuple[ModelSource, mc.ModelConfig]:
    folder = tmp_path / "affine"
    for name in files:
        (folder / "1").mkdir(parents=True, exist_ok=True)
        (folder / "1" / name).write_bytes(affine_onnx() if name.endswith(".onnx") else b"om")
    config = _config(AFFINE + 'instance_group [ { kind: KIND_GPU gpus: [ 0 ] } ] default_model_filename: "model.om"')
    return ModelSource("affine", folder), config


def _resolve(tmp_path: Path, files: tuple[str, ...], **settings: object) -> tuple[mc.ModelConfig, str]:
    source, config = _ge_model(tmp_path, files)
    resolved = NpuResolver(WorkerSettings(**settings)).resolve(source, config, registry.by_name("ge"), 1)  # type: ignore[arg-type]
    return resolved.config, resolved.backend.name


def test_without_npus_model_onnx_is_served_by_onnx_runtime_on_the_cpu_saying_why(tmp_path: Path) -> None:
    config, backend = _resolve(tmp_path, ("model.onnx", "model.om"))
    assert backend == "onnxruntime"
    assert (config.backend, config.platform, config.default_model_filename) == (
        "onnxruntime",
        "onnxruntime_onnx",
        "model.onnx",
    )
    assert config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU and not config.instance_group[0].gpus
    assert "this host has no NPU" in config.parameters[FALLBACK_PARAMETER].string_value


def test_npu_off_serves_onnx_runtime_even_with_npus_and_refuses_an_om_only_version(tmp_path: Path) -> None:
    config, backend = _resolve(tmp_path, ("model.onnx", "model.om"), npu_mode="off", device_ids=(0,))
    assert backend == "onnxruntime" and "--npu=off" in config.parameters[FALLBACK_PARAMETER].string_value
    with pytest.raises(ModelLoadError, match="--npu=off serves 'ge' models with ONNX Runtime, but"):
        _resolve(tmp_path / "other", ("model.om",), npu_mode="off")


def test_npu_required_fails_where_auto_falls_back(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"version 1: --npu=required, but this host has no NPU"):
        _resolve(tmp_path, ("model.onnx",), npu_mode="required")


def test_an_om_only_version_without_npus_stays_with_the_ge_backend(tmp_path: Path) -> None:
    config, backend = _resolve(tmp_path, ("model.om",))
    assert backend == "ge" and FALLBACK_PARAMETER not in config.parameters


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (
            ["--framework=5", "--model=M", "--output=o", "--soc_version=Ascend310", "--speed=11"],
            "unknown parameter --speed",
        ),
        (["--framework=5", "--model=M", "--output=o"], "['--soc_version'] are missing"),
        (
            ["--framework=5", "--model=M", "--output=o", "--soc_version=Ascend310", "--input_shape=x-1,4"],
            "is not name:d1",
        ),
        (
            ["--framework=5", "--model=M", "--output=o", "--soc_version=Ascend310", "--input_shape=x:a,4"],
            "not an integer",
        ),
        (
            [
                "--framework=5",
                "--model=M",
                "--output=o",
                "--soc_version=Ascend310",
                "--input_shape=x:-1,4",
                "--dynamic_batch_size=4",
            ],
            "2-100 unique positive gears",
        ),
        (
            [
                "--framework=5",
                "--model=M",
                "--output=o",
                "--soc_version=Ascend310",
                "--input_shape=x:1,4",
                "--dynamic_batch_size=1,2",
            ],
            "needs -1 as the first dim",
        ),
        (
            ["--framework=5", "--model=M", "--output=o", "--soc_version=Ascend310", "--input_shape=y:1,4"],
            "not inputs of the model",
        ),
    ],
)
def test_the_stand_in_atc_checks_its_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], error: str
) -> None:
    model = tmp_path / "m.onnx"
    model.write_bytes(affine_onnx())
    argv = [item.replace("=M", f"={model}").replace("=o", f"={tmp_path / 'o'}") for item in argv]
    assert fake_atc.main(argv) == 1
    out = capsys.readouterr().out
    assert error in out and "ATC run failed" in out
    assert not (tmp_path / "o.om").exists()


def test_npu_and_model_cache_dir_reach_the_worker_settings() -> None:
    from geserve.cli import parse_settings

    settings = parse_settings(["--model-repository=/m", "--npu=required", "--model-cache-dir=/var/cache/om"])
    assert (settings.workers.npu_mode, settings.workers.model_cache_dir) == ("required", Path("/var/cache/om"))
    defaults = parse_settings(["--model-repository=/m"])
    assert (defaults.workers.npu_mode, defaults.workers.model_cache_dir) == ("auto", None)
    with pytest.raises(SystemExit):
        parse_settings(["--model-repository=/m", "--npu=sometimes"])


def test_the_default_cache_is_under_the_user_cache_dir() -> None:
    assert cache.default_dir({"XDG_CACHE_HOME": "/c"}) == Path("/c/geserve/om")
    assert cache.default_dir({}) == Path.home() / ".cache" / "geserve" / "om"


def test_check_accepts_an_onnx_only_ge_version_and_reports_what_keeps_it_from_compiling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from geserve.cli import main

    source, _ = _ge_model(tmp_path / "models", ("model.onnx",))
    (source.path / "config.pbtxt").write_text(AFFINE)
    assert main(["check", "--model-repository", str(tmp_path / "models")]) == 0, capsys.readouterr().out
    capsys.readouterr()
    (source.path / "config.pbtxt").write_text(
        AFFINE + 'parameters { key: "atc_option.turbo" value { string_value: "1" } }'
    )
    assert main(["check", "--model-repository", str(tmp_path / "models")]) == 1
    out = capsys.readouterr().out
    assert "compiling" in out and "atc_option.turbo name no ATC flag" in out


def _toolchain(tmp_path: Path, script: str, timeout_s: float = 60) -> compiler.Toolchain:
    atc = tmp_path / "bin" / "atc"
    atc.parent.mkdir(parents=True, exist_ok=True)
    atc.write_text(f"#!/bin/sh\n{script}\n")
    atc.chmod(0o755)
    return compiler.Toolchain(str(atc), "Ascend310P3", "8.0.RC1", tmp_path / "cache", timeout_s)


def _onnx_source(tmp_path: Path) -> Path:
    onnx = tmp_path / "affine" / "1" / "model.onnx"
    onnx.parent.mkdir(parents=True)
    onnx.write_bytes(affine_onnx())
    return onnx


def test_a_failed_compile_names_the_command_and_atcs_last_lines_and_leaves_nothing(tmp_path: Path) -> None:
    onnx = _onnx_source(tmp_path)
    script = 'for i in $(seq 1 40); do echo "progress $i"; done; echo "E19999: the real reason" >&2; exit 3'
    with pytest.raises(ModelLoadError) as caught:
        compiler.compile_version(_config(AFFINE), onnx, onnx.parent.parent, _toolchain(tmp_path, script))
    message = caught.value.message
    assert "ATC failed (exit 3)" in message and "--dynamic_batch_size=1,4,8,16" in message
    # What follows ATC's own lines is what the python3 ATC found lacks, which depends on this host.
    atc_output = re.split(r"\n(?=ATC's python3|ATC finds no python3)", message)[0]
    assert atc_output.endswith("E19999: the real reason") and "progress 40" in message and "progress 1\n" not in message
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_compile_that_outlives_its_limit_fails_the_load(tmp_path: Path) -> None:
    onnx = _onnx_source(tmp_path)
    with pytest.raises(ModelLoadError, match=r"ATC did not finish within 0\.5s"):
        compiler.compile_version(_config(AFFINE), onnx, onnx.parent.parent, _toolchain(tmp_path, "sleep 5", 0.5))
    assert list((tmp_path / "cache").iterdir()) == []


def test_staging_folders_a_killed_server_left_are_swept(tmp_path: Path) -> None:
    import os

    old = cache.staging(tmp_path, 60)
    os.utime(old, (0, 0))
    fresh = cache.staging(tmp_path, 60)
    assert not old.exists() and fresh.is_dir()
    assert cache.staging(tmp_path, 60).is_dir() and fresh.is_dir()  # a compile still running is left alone


def test_a_config_without_inputs_takes_them_from_the_onnx_graph(tmp_path: Path) -> None:
    onnx = _onnx_source(tmp_path)
    bare = _config('name: "affine" backend: "ge" max_batch_size: 8')
    completed = graph_inputs.complete_inputs(bare, onnx)
    assert [(t.name, list(t.dims)) for t in completed.input] == [("x", [4])] and not bare.input
    assert command.build(completed, "S", []).arguments[0] == "--input_shape=x:-1,4"
    unbatched = graph_inputs.complete_inputs(_config('name: "affine"'), onnx)
    with pytest.raises(ModelLoadError, match=r"input 'x' has variable dims \[-1, 4\]"):
        command.build(unbatched, "S", [])


def test_geserve_compile_without_pyacl_asks_for_the_chip_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from geserve.cli import main

    fake_atc.install(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.delenv("PYTHONPATH", raising=False)  # no simulator: the chip cannot be asked
    source, _ = _ge_model(tmp_path / "models", ("model.onnx",))
    (source.path / "config.pbtxt").write_text(AFFINE)
    code = main(["compile", "--model-repository", str(tmp_path / "models"), "--model-cache-dir", str(tmp_path / "c")])
    out = capsys.readouterr().out
    assert code == 1 and "affine version 1: failed: cannot ask pyACL for the chip name" in out
    assert "give --soc-version" in out


def test_with_npus_but_no_atc_auto_and_required_fail_naming_atc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NPUs are here: serving their models on the CPU would hide a broken CANN setup behind a ready server."""
    monkeypatch.setattr(host, "has_pyacl", lambda: True)
    monkeypatch.setattr(host, "find_atc", lambda: None)
    with pytest.raises(ModelLoadError, match=r"CANN's atc is not on PATH to compile it .*--npu=off serves model\.onnx"):
        _resolve(tmp_path, ("model.onnx",), device_ids=(0,))
    with pytest.raises(ModelLoadError, match=r"--npu=required, but the version folder holds model\.onnx and no \.om"):
        _resolve(tmp_path / "again", ("model.onnx",), device_ids=(0,), npu_mode="required")
    config, backend = _resolve(tmp_path / "shipped", ("model.onnx", "model.om"), device_ids=(0,))
    assert backend == "ge" and FALLBACK_PARAMETER not in config.parameters  # an .om ships: no compile needed


def test_onnx_inputs_never_get_nhwc_an_nhwc_input_is_labelled_nd_and_bad_formats_are_refused(tmp_path: Path) -> None:
    nhwc = _config(
        'name: "m" max_batch_size: 0 input [ { name: "x" format: FORMAT_NHWC data_type: TYPE_FP32 dims: [ 1, 8, 8, 3 ] } ]'
    )
    assert "--input_format=ND" in command.build(nhwc, "Ascend310P3", []).arguments
    nchw = _config('name: "m" max_batch_size: 0 input [ { name: "x" format: FORMAT_NCHW dims: [ 1, 3, 8, 8 ] } ]')
    assert "--input_format=NCHW" in command.build(nchw, "Ascend310P3", []).arguments
    plain = _config('name: "m" max_batch_size: 0 input [ { name: "x" dims: [ 1, 3, 8, 8 ] } ]')
    with pytest.raises(ModelLoadError, match=r"'atc_option\.input_format' is 'NHWC'; ATC takes NCHW, NCDHW, ND"):
        command.build(plain, "S", [options.AtcOption("input_format", "NHWC")])
    (tmp_path / "aipp.cfg").write_text("aipp_op {}")
    aipp = options.parse({"atc_option.insert_op_conf": "aipp.cfg"}, "m", tmp_path)
    with pytest.raises(ModelLoadError, match="insert_op_conf' \\(AIPP\\) ATC takes --input_format=NCHW"):
        command.build(nhwc, "S", aipp)


def test_reshape_gives_the_model_shape_atc_compiles() -> None:
    config = _config('name: "m" max_batch_size: 8 input [ { name: "x" dims: [ 12 ] reshape { shape: [ 3, 4 ] } } ]')
    assert command.build(config, "S", []).arguments[0] == "--input_shape=x:-1,3,4"


def test_op_precision_mode_is_a_file_in_the_model_folder_and_part_of_the_key(tmp_path: Path) -> None:
    (tmp_path / "ops.ini").write_text("[ByOpType]\nSoftmax=high_precision\n")
    [option] = options.parse({"atc_option.op_precision_mode": "ops.ini"}, "m", tmp_path)
    assert option.file == (tmp_path / "ops.ini").resolve() and option.value == str(option.file)
    with pytest.raises(ModelLoadError, match="names no file inside the model folder"):
        options.parse({"atc_option.op_precision_mode": "missing.ini"}, "m", tmp_path)


def test_the_cache_key_names_option_files_by_their_place_in_the_model_folder(tmp_path: Path) -> None:
    keys = []
    for where in ("first", "second"):  # the same repository copied to another folder (an S3 mirror at start)
        folder = tmp_path / where / "m"
        (folder / "1").mkdir(parents=True)
        (folder / "1" / "model.onnx").write_bytes(affine_onnx())
        (folder / "aipp.cfg").write_text("aipp_op {}")
        parsed = options.parse({"atc_option.insert_op_conf": "aipp.cfg"}, "m", folder)
        built = command.build(_config(AFFINE), "Ascend310P3", parsed)
        assert f"--insert_op_conf={(folder / 'aipp.cfg').resolve()}" in built.arguments  # ATC gets the real path
        keys.append(cache.key(folder / "1" / "model.onnx", built, "Ascend310P3", "8.0.RC1"))
    assert keys[0] == keys[1]


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        (["--input_format=NHWC"], "--input_format=NHWC is not one of ['NCHW', 'NCDHW', 'ND']"),
        (["--precision_mode=fast"], "--precision_mode=fast is not a precision mode"),
        (["--output_type=FP33"], "['FP33'] name no output type"),
        (["--op_precision_mode=/nonexistent/ops.ini"], "the file does not exist"),
        (["--insert_op_conf=/nonexistent/aipp.cfg"], "the file does not exist"),
    ],
)
def test_the_stand_in_atc_checks_the_values_the_docs_constrain(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], error: str
) -> None:
    model = tmp_path / "m.onnx"
    model.write_bytes(affine_onnx())
    base = ["--framework=5", f"--model={model}", f"--output={tmp_path / 'o'}", "--soc_version=Ascend310P3"]
    assert fake_atc.main([*base, "--input_shape=x:1,4", "--output_type=FP32", "--input_format=ND"]) == 0
    assert fake_atc.main([*base, "--input_shape=x:1,4", *extra]) == 1
    assert error in capsys.readouterr().out


_WRITES_OM = 'for a; do case $a in --output=*) out=${a#--output=};; esac; done; echo om > "$out.om"'


def test_a_timed_out_compile_kills_atc_and_every_process_it_started(tmp_path: Path) -> None:
    onnx = _onnx_source(tmp_path)
    child = tmp_path / "child.pid"
    script = f"sleep 300 & echo $! > {child}; wait"  # ATC's own compiler processes
    with pytest.raises(ModelLoadError, match=r"ATC did not finish within 0\.5s \(parameter 'atc_timeout_s'"):
        compiler.compile_version(_config(AFFINE), onnx, onnx.parent.parent, _toolchain(tmp_path, script, 0.5))
    pid = int(child.read_text())
    # Killed with its group; a signal lands asynchronously, so its death is waited for (a loaded machine is slow).
    deadline = time.monotonic() + 10
    while _state(pid) == "alive" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _state(pid) in ("gone", "zombie")


def _state(pid: int) -> str:
    try:
        return "zombie" if Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z" else "alive"
    except OSError:
        return "gone"


def test_atc_timeout_s_sets_a_models_limit_and_bad_values_are_refused(tmp_path: Path) -> None:
    onnx = _onnx_source(tmp_path)
    limited = _config(AFFINE + 'parameters { key: "atc_timeout_s" value { string_value: "0.5" } }')
    with pytest.raises(ModelLoadError, match=r"within 0\.5s"):
        compiler.compile_version(limited, onnx, onnx.parent.parent, _toolchain(tmp_path, "sleep 5", 60))
    bad = _config(AFFINE + 'parameters { key: "atc_timeout_s" value { string_value: "soon" } }')
    with pytest.raises(ModelLoadError, match="parameter 'atc_timeout_s' is 'soon'"):
        compiler.compile_version(bad, onnx, onnx.parent.parent, _toolchain(tmp_path, "exit 0", 60))


def test_an_unusable_cache_folder_is_a_load_error_naming_it_and_the_flag(tmp_path: Path) -> None:
    onnx = _onnx_source(tmp_path)
    (tmp_path / "file").write_text("not a folder")
    tools = replace(_toolchain(tmp_path, _WRITES_OM), cache_dir=tmp_path / "file" / "om")
    with pytest.raises(ModelLoadError, match=r"cache '.*file/om' cannot be used .*give --model-cache-dir a folder"):
        compiler.compile_version(_config(AFFINE), onnx, onnx.parent.parent, tools)


def test_a_published_entry_is_readable_by_other_users_and_atc_gets_an_op_cache_inside_the_cache(
    tmp_path: Path,
) -> None:
    onnx = _onnx_source(tmp_path)
    tools = _toolchain(tmp_path, _WRITES_OM)
    compiled = compiler.compile_version(_config(AFFINE), onnx, onnx.parent.parent, tools)
    assert compiled.compiled and compiled.om.stat().st_mode & 0o777 == 0o644
    assert compiled.om.parent.stat().st_mode & 0o777 == 0o755
    assert f"--op_compiler_cache_dir={tools.cache_dir / compiler.OP_CACHE}" in compiled.argv


def test_without_set_env_the_cann_version_is_found_from_atcs_place_and_unknown_is_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    version = tmp_path / "Ascend" / "ascend-toolkit" / "8.0.RC2"
    fake_atc.install_cann(version, "8.0.RC2")
    for binary in (version / "bin" / "atc", version / "compiler" / "bin" / "atc"):
        binary.parent.mkdir(parents=True, exist_ok=True)
        binary.write_text("#!/bin/sh\n")
    latest = tmp_path / "Ascend" / "ascend-toolkit" / "latest"
    latest.symlink_to(version)
    assert host.cann_version({}, atc=str(latest / "bin" / "atc")) == "8.0.RC2"
    assert host.cann_version({}, atc=str(version / "compiler" / "bin" / "atc")) == "8.0.RC2"
    assert "CANN version is unknown" not in caplog.text
    assert host.cann_version({}, atc=str(tmp_path / "elsewhere" / "bin" / "atc")) == "unknown"
    assert "CANN version is unknown" in caplog.text and "set_env.sh" in caplog.text
