"""EXECUTION_ENV_PATH's parts: the path's keyword, the content-keyed cache, refused archives, the version checks."""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import re
import shutil
import sys
import tarfile
import threading
from collections.abc import Iterator
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from geserve._generated import model_config_pb2 as mc
from geserve.backends import registry
from geserve.errors import ModelLoadError
from geserve.repository.scan import ModelSource
from geserve.settings import WorkerSettings
from geserve.workers import execution_env
from geserve.workers.environment_process import EnvironmentProcess, launch_environment, preparation_data
from geserve.workers.placement import instance_specs

SERVER = f"{sys.version_info.major}.{sys.version_info.minor}"


def _config(value: str | None) -> mc.ModelConfig:
    config = mc.ModelConfig(name="m", backend="python")
    if value is not None:
        config.parameters[execution_env.PARAMETER].string_value = value
    return config


def _archive(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            member = tarfile.TarInfo(name)
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    return path


def _fake_interpreter(root: Path, version: list[int], numpy: bool = True) -> Path:
    """An environment whose bin/python3 answers the probe as an interpreter of `version` would."""
    answer = json.dumps({"version": version, "path": [str(root / "lib")], "numpy": numpy, "protobuf": True})
    interpreter = root / "bin" / "python3"
    interpreter.parent.mkdir(parents=True)
    interpreter.write_text(f"#!/bin/sh\necho '{answer}'\n")
    interpreter.chmod(0o755)
    return root


def test_the_model_directory_keyword_is_replaced_once(tmp_path: Path) -> None:
    keyword = execution_env.MODEL_DIRECTORY_KEYWORD
    assert execution_env.requested_path(_config(f"{keyword}/env.tar.gz"), tmp_path) == tmp_path / "env.tar.gz"
    assert execution_env.requested_path(_config("/opt/env.tar.gz"), tmp_path) == Path("/opt/env.tar.gz")
    # As Triton's: only the first occurrence.
    assert execution_env.requested_path(_config(f"{keyword}/{keyword}"), tmp_path) == Path(f"{tmp_path}/{keyword}")
    assert execution_env.requested_path(_config(None), tmp_path) is None
    assert execution_env.requested_path(_config(""), tmp_path) is None


def test_the_cache_lies_in_the_user_cache_folder_or_a_private_temporary_one() -> None:
    assert execution_env.cache_directory({"XDG_CACHE_HOME": "/c"}) == Path("/c/geserve/execution-envs")
    assert execution_env.cache_directory({}).parent.name == f"geserve-{os.getuid()}"


def test_an_archive_is_unpacked_once_per_content(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = _archive(tmp_path / "a.tar.gz", {"lib/marker.txt": b"one"})
    unpacked = execution_env.unpack(first, cache, "m")
    assert (unpacked / "lib" / "marker.txt").read_bytes() == b"one"
    (unpacked / "lib" / "marker.txt").write_bytes(b"touched")  # not unpacked again: the change stays
    copy = tmp_path / "copy.tar.gz"
    copy.write_bytes(first.read_bytes())
    assert execution_env.unpack(copy, cache, "m") == unpacked
    assert (unpacked / "lib" / "marker.txt").read_bytes() == b"touched"
    changed = execution_env.unpack(_archive(tmp_path / "b.tar.gz", {"lib/marker.txt": b"two"}), cache, "m")
    assert changed != unpacked and (changed / "lib" / "marker.txt").read_bytes() == b"two"


def test_concurrent_loads_share_one_unpacking(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    archive = _archive(tmp_path / "env.tar.gz", {f"lib/file{i}": b"x" * 1000 for i in range(50)})
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(execution_env.unpack(archive, cache, "m"))) for _ in "1234"
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and len(set(results)) == 1
    assert sorted(path.name for path in cache.iterdir() if path.is_dir()) == [results[0].name]  # no staging left


@pytest.mark.parametrize(
    ("files", "links"),
    [
        ({"../escaped": b"x"}, {}),
        ({"link/escaped": b"x"}, {"link": ".."}),
        ({}, {"outside": "/etc/passwd"}),
    ],
    ids=["dot-dot", "through-a-link", "absolute-link"],
)
def test_members_that_leave_the_environment_are_refused(
    tmp_path: Path, files: dict[str, bytes], links: dict[str, str]
) -> None:
    # Links first, so that a member written through one is tried after it exists.
    archive = tmp_path / "work" / "evil.tar.gz"
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tar:
        for name, target in links.items():
            member = tarfile.TarInfo(name)
            member.type, member.linkname = tarfile.SYMTYPE, target
            tar.addfile(member)
        for name, data in files.items():
            member = tarfile.TarInfo(name)
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    cache = tmp_path / "work" / "cache"
    with pytest.raises(ModelLoadError, match="would not stay inside the environment, refused"):
        execution_env.unpack(archive, cache, "m")
    assert not (tmp_path / "work" / "escaped").exists()
    assert [path for path in cache.iterdir() if path.is_dir()] == []  # nothing half unpacked stays


def test_an_absolute_member_name_lands_inside_the_environment(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    archive = _archive(tmp_path / "env.tar.gz", {str(outside): b"x"})
    unpacked = execution_env.unpack(archive, tmp_path / "cache", "m")
    assert not outside.exists()
    assert (unpacked / str(outside).lstrip("/")).read_bytes() == b"x"


def test_a_missing_path_or_a_bad_archive_fails_the_load(tmp_path: Path) -> None:
    missing = _config(f"{execution_env.MODEL_DIRECTORY_KEYWORD}/env.tar.gz")
    with pytest.raises(ModelLoadError, match=f"Failed to get the canonical path for {tmp_path}/env.tar.gz"):
        execution_env.prepare(missing, tmp_path, tmp_path / "cache")
    (tmp_path / "env.tar.gz").write_bytes(b"not an archive")
    with pytest.raises(ModelLoadError, match="is not a readable tar archive"):
        execution_env.prepare(missing, tmp_path, tmp_path / "cache")


def test_an_environment_without_an_interpreter_fails_the_load(tmp_path: Path) -> None:
    (tmp_path / "env" / "lib").mkdir(parents=True)
    with pytest.raises(ModelLoadError, match=r"bin/python3 does not exist. The Python environment should contain"):
        execution_env.prepare(_config(str(tmp_path / "env")), tmp_path, tmp_path / "cache")


def test_an_environment_of_another_python_is_refused_by_its_layout(tmp_path: Path) -> None:
    env = _fake_interpreter(tmp_path / "env", [*sys.version_info[:2]])
    (env / "lib" / "python3.7").mkdir(parents=True)
    with pytest.raises(ModelLoadError, match=rf"is Python 3.7, but geserve runs Python {SERVER}: .* must match"):
        execution_env.prepare(_config(str(env)), tmp_path, tmp_path / "cache")


def test_an_interpreter_of_another_python_is_refused(tmp_path: Path) -> None:
    env = _fake_interpreter(tmp_path / "env", [3, sys.version_info.minor + 1])
    with pytest.raises(ModelLoadError, match=rf"is Python 3.{sys.version_info.minor + 1}, but geserve runs"):
        execution_env.prepare(_config(str(env)), tmp_path, tmp_path / "cache")


def test_an_environment_without_numpy_is_refused(tmp_path: Path) -> None:
    env = _fake_interpreter(tmp_path / "env", [*sys.version_info[:2]], numpy=False)
    with pytest.raises(ModelLoadError, match="has no numpy"):
        execution_env.prepare(_config(str(env)), tmp_path, tmp_path / "cache")


def test_a_working_environment_gives_its_interpreter_and_path_with_geserve_first(tmp_path: Path) -> None:
    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python3").symlink_to(sys.executable)  # this interpreter stands for the environment's
    prepared = execution_env.prepare(_config(str(env)), tmp_path, tmp_path / "cache")
    assert prepared is not None
    assert prepared.interpreter == str(env / "bin" / "python3")
    geserve_folder = Path(prepared.search_path[0])
    assert sorted(path.name for path in geserve_folder.iterdir()) == ["geserve"]
    assert (geserve_folder / "geserve" / "__init__.py").is_file()
    assert dict(prepared.variables)["PATH"].startswith(f"{env / 'bin'}{os.pathsep}")
    assert execution_env.prepare(_config(None), tmp_path) is None


def _folder_environment(tmp_path: Path) -> Path:
    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python3").symlink_to(sys.executable)  # this interpreter stands for the environment's
    return env


def test_a_cache_folder_others_may_write_to_is_refused_for_a_folder_environment_too(tmp_path: Path) -> None:
    env = _folder_environment(tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ModelLoadError, match="only it may write to"):
        execution_env.prepare(_config(str(env)), tmp_path, shared / "cache")
    assert not (shared / "cache" / "runtime").exists()  # nothing of the cache was used
    linked = tmp_path / "linked"
    linked.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(ModelLoadError, match=f"cache {linked} is not a folder of this user's"):
        execution_env.prepare(_config(str(env)), tmp_path, linked)
    assert list((tmp_path / "elsewhere").iterdir()) == []
    assert execution_env.prepare(_config(str(env)), tmp_path, tmp_path / "cache") is not None


@pytest.mark.skipif(os.getuid() != 0, reason="making a folder another user's needs root")
def test_a_cache_folder_of_another_user_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    theirs = tmp_path / "geserve-shared" / "execution-envs"
    theirs.mkdir(parents=True)
    theirs.chmod(0o775)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(ModelLoadError, match="only it may write to"):
        execution_env.unpack(_archive(tmp_path / "env.tar.gz", {"lib/x": b"x"}), theirs, "m")
    assert theirs.stat().st_mode & 0o777 == 0o775 and theirs.stat().st_uid == 65534
    assert (execution_env.unpack(tmp_path / "env.tar.gz", tmp_path / "cache", "m") / "lib" / "x").is_file()


def test_a_planted_runtime_entry_is_replaced_by_the_link_to_geserve(tmp_path: Path) -> None:
    env, cache = _folder_environment(tmp_path), tmp_path / "cache"
    prepared = execution_env.prepare(_config(str(env)), tmp_path, cache)
    assert prepared is not None
    runtime = Path(prepared.search_path[0])
    # What someone could have left there before the cache was private: a real package under geserve's name.
    (runtime / "geserve").unlink()
    (runtime / "geserve").mkdir()
    (runtime / "geserve" / "__init__.py").write_text("raise SystemExit('planted')\n")
    (runtime / "extra").mkdir()
    again = execution_env.prepare(_config(str(env)), tmp_path, cache)
    assert again is not None and again.search_path[0] == str(runtime)
    assert sorted(path.name for path in runtime.iterdir()) == ["geserve"]
    assert (runtime / "geserve").is_symlink()
    assert (runtime / "geserve").resolve() == Path(execution_env.geserve.__file__).parent.resolve()
    # A link in the entry's place is replaced too, and what it points at is left alone.
    decoy = tmp_path / "decoy"
    (decoy / "geserve").mkdir(parents=True)
    shutil.rmtree(runtime)
    runtime.symlink_to(decoy, target_is_directory=True)
    third = execution_env.prepare(_config(str(env)), tmp_path, cache)
    assert third is not None and not Path(third.search_path[0]).is_symlink()
    assert (Path(third.search_path[0]) / "geserve").is_symlink() and (decoy / "geserve").is_dir()


@pytest.fixture
def umask_002() -> Iterator[None]:
    previous = os.umask(0o002)
    try:
        yield
    finally:
        os.umask(previous)


@pytest.mark.usefixtures("umask_002")
def test_with_a_group_writable_umask_the_cache_is_created_private(tmp_path: Path) -> None:
    cache = execution_env.cache_directory({"XDG_CACHE_HOME": str(tmp_path / "xdg")})
    archive = _archive(tmp_path / "env.tar.gz", {"lib/x": b"x"})
    assert (execution_env.unpack(archive, cache, "m") / "lib" / "x").is_file()
    for folder in (cache, cache.parent):
        assert folder.stat().st_mode & 0o777 == 0o700, folder
    # A folder of ours left group-writable (by a server run before under this umask) is made private again.
    cache.parent.chmod(0o775)
    cache.chmod(0o775)
    assert (execution_env.unpack(archive, cache, "m") / "lib" / "x").is_file()
    assert cache.parent.stat().st_mode & 0o777 == 0o700 and cache.stat().st_mode & 0o777 == 0o700


@pytest.mark.usefixtures("umask_002")
def test_with_a_group_writable_umask_a_folder_environment_prepares(tmp_path: Path) -> None:
    cache = tmp_path / "geserve-1" / "execution-envs"
    prepared = execution_env.prepare(_config(str(_folder_environment(tmp_path))), tmp_path, cache)
    assert prepared is not None
    for folder in (cache.parent, cache, cache / "runtime", Path(prepared.search_path[0])):
        assert folder.stat().st_mode & 0o777 == 0o700, folder


def test_a_symlinked_cache_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "geserve-1").symlink_to(tmp_path / "real", target_is_directory=True)
    archive = _archive(tmp_path / "env.tar.gz", {"lib/x": b"x"})
    with pytest.raises(ModelLoadError, match="geserve-1 is not a folder of this user's"):
        execution_env.unpack(archive, tmp_path / "geserve-1" / "execution-envs", "m")
    assert list((tmp_path / "real").iterdir()) == []
    assert (execution_env.unpack(archive, tmp_path / "geserve-2" / "execution-envs", "m") / "lib" / "x").is_file()


def test_the_worker_starts_with_the_environment_path_and_not_the_server_main() -> None:
    data = preparation_data("worker", ("/geserve-only", "/env/lib/python3.x"))
    assert data["sys_path"] == ["/geserve-only", "/env/lib/python3.x"]
    assert "init_main_from_name" not in data and "init_main_from_path" not in data


def _report_interpreter(connection: Connection) -> None:
    connection.send(
        {
            "ignore_environment": sys.flags.ignore_environment,
            "no_user_site": sys.flags.no_user_site,
            "ld_library_path": os.environ.get("LD_LIBRARY_PATH"),
            "executable": sys.executable,
        }
    )


def test_the_worker_interpreter_ignores_the_server_python_variables_and_finds_the_environment_libraries_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = _folder_environment(tmp_path)
    # The launch starts this process's resource tracker if it is not running yet, with this process's variables:
    # started under the PYTHONHOME below, it would die at once, and every later test of this process with it.
    resource_tracker.ensure_running()
    # A PYTHONHOME of the server's would make the environment's interpreter look for its standard library there.
    monkeypatch.setenv("PYTHONHOME", str(tmp_path / "no-python-here"))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "nothing"))
    monkeypatch.setenv("LD_LIBRARY_PATH", "/server/lib")
    parent, child = multiprocessing.get_context("spawn").Pipe()
    repository_root = str(Path(__file__).resolve().parents[2])
    process = EnvironmentProcess(
        str(env / "bin" / "python3"), (repository_root, *sys.path), target=_report_interpreter, args=(child,)
    )
    process.start()
    child.close()
    try:
        report = parent.recv()  # EOFError, rather than a wait, if the worker dies first
    finally:
        process.join(60)
    assert process.exitcode == 0
    assert report == {
        "ignore_environment": 1,
        "no_user_site": 1,
        "ld_library_path": f"{env / 'lib'}{os.pathsep}/server/lib",
        "executable": str(env / "bin" / "python3"),
    }
    monkeypatch.delenv("LD_LIBRARY_PATH")
    assert launch_environment("/e/bin/python3", {})["LD_LIBRARY_PATH"] == "/e/lib"  # no empty entry after it


def _python_model(tmp_path: Path, env: Path) -> tuple[ModelSource, mc.ModelConfig]:
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.py").write_text("")
    config = _config(str(env))
    config.instance_group.add(name="m", count=2, kind=mc.ModelInstanceGroup.KIND_CPU)
    return ModelSource("m", tmp_path / "m"), config


def test_every_instance_of_a_python_model_runs_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python3").symlink_to(sys.executable)
    source, config = _python_model(tmp_path, env)
    specs = instance_specs(source, config, registry.by_name("python"), 1, WorkerSettings())
    assert [spec.interpreter for spec in specs] == [str(env / "bin" / "python3")] * 2
    assert all(spec.search_path and dict(spec.environment)["PATH"].startswith(str(env)) for spec in specs)


def test_a_server_running_backends_on_threads_refuses_an_environment(tmp_path: Path) -> None:
    source, config = _python_model(tmp_path, tmp_path / "env")
    with pytest.raises(ModelLoadError, match="EXECUTION_ENV_PATH runs the model's instances with the environment's"):
        instance_specs(source, config, registry.by_name("python"), 1, WorkerSettings(process_workers=False))


def _long_link_chain_archive(archive: Path, destination_length: int) -> None:
    """CVE-2025-4517's construction: directories with names long enough that a chain of links to them, expanded,
    passes PATH_MAX, where os.path.realpath (and so tarfile's "data" filter before Python 3.11.13) stops resolving;
    a link past that point then climbs out unchecked, and a hard link and a file are written through it."""
    steps = "abcdefghijklmnop"
    component = "d" * ((os.pathconf("/", "PC_PATH_MAX") - destination_length) // (len(steps) + 1))
    with tarfile.open(archive, "w:gz") as tar:

        def add(name: str, kind: bytes, linkname: str = "", data: bytes = b"") -> None:
            member = tarfile.TarInfo(name)
            member.type, member.linkname, member.size = kind, linkname, len(data)
            member.mode = 0o777 if kind == tarfile.DIRTYPE else 0o644
            tar.addfile(member, io.BytesIO(data) if data else None)

        path = ""
        for step in steps:
            add(os.path.join(path, component), tarfile.DIRTYPE)
            add(os.path.join(path, step), tarfile.SYMTYPE, component)
            path = os.path.join(path, component)
        deepest = os.path.join(*steps, "l" * 254)
        add(deepest, tarfile.SYMTYPE, os.path.join(*([".."] * len(steps))))
        add("escape", tarfile.SYMTYPE, os.path.join(deepest, ".."))
        add("flaglink", tarfile.LNKTYPE, os.path.join("escape", "flag"))
        add("flaglink", tarfile.REGTYPE, data=b"overwritten")
        add("escape/newfile", tarfile.REGTYPE, data=b"new")


def test_a_chain_of_links_past_path_max_does_not_write_outside(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    flag = cache / "flag"  # beside the folder the archive is unpacked into: where "escape" leads
    flag.write_bytes(b"kept")
    archive = tmp_path / "chain.tar.gz"
    # The staging folder's name: `.<key>.` and mkdtemp's eight characters, inside the cache.
    _long_link_chain_archive(archive, len(str(cache)) + 1 + 1 + 64 + 1 + 8 + 1)
    with pytest.raises(ModelLoadError, match=r"lies inside the link 'a'|would not stay inside the environment"):
        execution_env.unpack(archive, cache, "m")
    assert flag.read_bytes() == b"kept" and not (cache / "newfile").exists()
    assert [path.name for path in cache.iterdir() if path.is_dir()] == []  # nothing half unpacked stays


@pytest.mark.parametrize(
    ("links", "files", "why"),
    [
        ({"up": "x/../.."}, {}, "links to 'x/../..', outside the folder"),
        ({"a": "b", "b": "a"}, {}, "outside the folder"),  # a loop resolves nowhere
        ({}, {"f": b"1", "g": b"2"}, ""),
    ],
    ids=["climbing-link", "link-loop", "plain-files"],
)
def test_links_are_resolved_through_the_archives_own_links(
    tmp_path: Path, links: dict[str, str], files: dict[str, bytes], why: str
) -> None:
    archive = tmp_path / "a.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, target in links.items():
            member = tarfile.TarInfo(name)
            member.type, member.linkname = tarfile.SYMTYPE, target
            tar.addfile(member)
        for name, data in files.items():
            member = tarfile.TarInfo(name)
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    if why:
        with pytest.raises(ModelLoadError, match=re.escape(why)):
            execution_env.unpack(archive, tmp_path / "cache", "m")
    else:
        assert (execution_env.unpack(archive, tmp_path / "cache", "m") / "g").read_bytes() == b"2"
