"""scripts/npu_preflight.py: each check on the inputs an Ascend host can give it, and the whole run on this one."""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from scripts import npu_preflight as preflight
from tests.fakes.om_models import write_affine_om
from tests.support import ROOT

SCRIPT = ROOT / "scripts" / "npu_preflight.py"
FAKES = ROOT / "tests" / "fakes"
HOME = "/usr/local/Ascend/ascend-toolkit/latest"
SOURCED = {
    "ASCEND_TOOLKIT_HOME": HOME,
    "ASCEND_HOME_PATH": HOME,
    "LD_LIBRARY_PATH": f"{HOME}/lib64:{HOME}/lib64/plugin/opskernel:/usr/local/Ascend/driver/lib64",
    "PYTHONPATH": f"{HOME}/python/site-packages:{HOME}/opp/built-in/op_impl/ai_core/tbe",
}
ASCEND_VARIABLES = ("ASCEND", "GESERVE_NPU", "LD_LIBRARY_PATH", "PYTHONPATH")


def _problems(checks: list[preflight.Check]) -> list[preflight.Check]:
    return [check for check in checks if check.problem]


def _host_environment(**extra: str) -> dict[str, str]:
    """This machine's environment without anything CANN or make npu-check would set."""
    kept = {key: value for key, value in os.environ.items() if not key.startswith(ASCEND_VARIABLES)}
    return {**kept, **extra}


@pytest.mark.parametrize("version", [(3, 11, 0), (3, 12, 1), (4, 0, 0)])
def test_python_311_and_newer_pass(version: tuple[int, int, int]) -> None:
    check = preflight.check_python(version, "/usr/bin/python3")
    assert not check.problem
    assert check.line() == f"ok       python: {'.'.join(map(str, version))} (/usr/bin/python3)"


@pytest.mark.parametrize("version", [(3, 6, 9), (3, 9, 2), (3, 10, 13)])
def test_an_older_python_names_311_and_the_make_variable_that_picks_the_interpreter(
    version: tuple[int, int, int],
) -> None:
    check = preflight.check_python(version, "/usr/bin/python3")
    assert "geserve needs Python 3.11 or newer" in check.problem
    assert "`make npu-check PYTHON=python3.11`" in check.fix
    assert check.line().startswith("PROBLEM  python: ")


def test_an_existing_venv_of_an_older_python_must_be_removed() -> None:
    old = preflight.check_venv("home = /usr/bin\nversion = 3.9.2\n", ".venv")
    assert old is not None
    assert "made with Python 3.9.2" in old.problem
    assert "make clean" in old.fix
    new = preflight.check_venv("home = /usr/bin\nversion_info = 3.11.7.final.0\n", ".venv")
    assert new is not None and not new.problem
    assert preflight.check_venv(None, ".venv") is None


def test_an_unsourced_set_env_is_one_problem_naming_the_file_to_source() -> None:
    checks = preflight.check_set_env({"PATH": "/usr/bin"})
    assert len(checks) == 1
    assert "set_env.sh was not sourced" in checks[0].problem
    assert "source /usr/local/Ascend/ascend-toolkit/set_env.sh" in checks[0].fix


def test_set_env_is_looked_for_where_cann_85_and_older_cann_install_it_newest_first() -> None:
    """CANN 8.5 and newer install /usr/local/Ascend/cann/set_env.sh, older ones
    /usr/local/Ascend/ascend-toolkit/set_env.sh: the fix names both, the one this host has is named first."""
    (check,) = preflight.check_set_env({"PATH": "/usr/bin"})
    assert check.fix == (
        "run `source /usr/local/Ascend/cann/set_env.sh` (CANN 8.5 and newer) or "
        "`source /usr/local/Ascend/ascend-toolkit/set_env.sh` (older CANN) in the shell that runs make"
    )
    both = {"/usr/local/Ascend/cann/set_env.sh", "/usr/local/Ascend/ascend-toolkit/set_env.sh"}
    assert preflight.installed_set_env(both.__contains__) == "/usr/local/Ascend/cann/set_env.sh"
    older = preflight.installed_set_env("/usr/local/Ascend/ascend-toolkit/set_env.sh".__eq__)
    assert older == "/usr/local/Ascend/ascend-toolkit/set_env.sh"
    assert preflight.installed_set_env(lambda path: False) is None
    (found,) = preflight.check_set_env({"PATH": "/usr/bin"}, "/usr/local/Ascend/cann/set_env.sh")
    assert found.problem == (
        "ASCEND_TOOLKIT_HOME and ASCEND_HOME_PATH are unset: CANN's set_env.sh was not sourced "
        "(this host has /usr/local/Ascend/cann/set_env.sh)"
    )
    assert (
        preflight.cann_paths({}, "/usr/local/Ascend/cann".__eq__)[-1] == "/usr/local/Ascend/cann/python/site-packages"
    )


def test_a_sourced_set_env_passes_and_a_path_it_should_have_set_is_named() -> None:
    assert not _problems(preflight.check_set_env(SOURCED))
    # ASCEND_HOME_PATH alone (newer set_env.sh files), with a trailing slash on the entries.
    home_only = {**SOURCED, "ASCEND_TOOLKIT_HOME": "", "LD_LIBRARY_PATH": f"{HOME}/lib64/"}
    assert not _problems(preflight.check_set_env(home_only))
    # LD_LIBRARY_PATH replaced after sourcing: only that variable is a problem.
    overwritten = preflight.check_set_env({**SOURCED, "LD_LIBRARY_PATH": "/opt/other/lib"})
    assert [check.name for check in _problems(overwritten)] == ["LD_LIBRARY_PATH"]
    assert f"holds no directory of {HOME} (such as {HOME}/lib64)" in overwritten[1].problem
    # A toolkit of the older layout: its libraries and pyACL in other directories of the home.
    older = {**SOURCED, "LD_LIBRARY_PATH": f"{HOME}/acllib/lib64", "PYTHONPATH": f"{HOME}/pyACL/python/site-packages"}
    assert not _problems(preflight.check_set_env(older))
    # A directory beside the home is not one of it.
    beside = preflight.check_set_env({**SOURCED, "LD_LIBRARY_PATH": f"{HOME}-old/lib64"})
    assert [check.name for check in _problems(beside)] == ["LD_LIBRARY_PATH"]


def _states(closed_at: str = "", group: str = "HwHiAiUser") -> list[preflight.PathState]:
    return [
        preflight.PathState(path, True, path != closed_at, "HwHiAiUser", group, stat.S_IFDIR | 0o750)
        for path in preflight.cann_paths({})
    ]


def test_the_paths_checked_run_from_the_ascend_root_down_to_pyacls_directory() -> None:
    assert preflight.cann_paths({}) == [
        "/usr/local/Ascend",
        "/usr/local/Ascend/ascend-toolkit",
        "/usr/local/Ascend/ascend-toolkit/latest",
        "/usr/local/Ascend/ascend-toolkit/latest/python",
        "/usr/local/Ascend/ascend-toolkit/latest/python/site-packages",
    ]
    assert preflight.cann_paths({"ASCEND_HOME_PATH": "/home/alice/Ascend/ascend-toolkit/latest/"}) == [
        "/home/alice/Ascend/ascend-toolkit",
        "/home/alice/Ascend/ascend-toolkit/latest",
        "/home/alice/Ascend/ascend-toolkit/latest/python",
        "/home/alice/Ascend/ascend-toolkit/latest/python/site-packages",
    ]


def test_a_toolkit_closed_to_a_user_outside_hwhiaiuser_names_the_directory_owner_mode_and_group_fix() -> None:
    check = preflight.check_cann_access(_states("/usr/local/Ascend/ascend-toolkit"), "alice", ["alice"])
    assert check.problem == (
        "/usr/local/Ascend/ascend-toolkit (owner HwHiAiUser, group HwHiAiUser, mode drwxr-x---) is closed to "
        "user alice, who is not in group HwHiAiUser"
    )
    assert "sudo usermod -a -G HwHiAiUser $USER" in check.fix
    assert "--install-for-all" in check.fix


def test_a_user_added_to_the_group_since_logging_in_is_told_to_log_in_again() -> None:
    check = preflight.check_cann_access(_states("/usr/local/Ascend/ascend-toolkit"), "alice", ["alice"], ["HwHiAiUser"])
    assert "after this login" in check.problem
    assert "newgrp HwHiAiUser" in check.fix
    assert "usermod" not in check.fix


def test_a_directory_closed_to_its_own_group_is_opened_not_joined() -> None:
    check = preflight.check_cann_access(_states(preflight.cann_paths({})[-1], group="root"), "alice", ["root"])
    assert "who is in group root" in check.problem
    assert "sudo chmod o+rx /usr/local/Ascend/ascend-toolkit/latest/python/site-packages" in check.fix


def test_a_missing_toolkit_and_an_open_one() -> None:
    missing = [state._replace(exists=False, usable=False) if index else state for index, state in enumerate(_states())]
    assert "/usr/local/Ascend/ascend-toolkit does not exist" in preflight.check_cann_access(missing, "a", []).problem
    nothing = [state._replace(exists=False, usable=False) for state in _states()]
    assert "no CANN toolkit at /usr/local/Ascend" in preflight.check_cann_access(nothing, "a", []).problem
    assert not preflight.check_cann_access(_states(), "alice", ["HwHiAiUser"]).problem


def test_path_state_reads_what_the_file_system_says(tmp_path: Path) -> None:
    folder = tmp_path / "toolkit"
    folder.mkdir(mode=0o750)
    state = preflight.path_state(str(folder))
    assert state.exists and state.usable
    assert stat.filemode(state.mode) == "drwxr-x---"
    assert state.owner == preflight._user_name(os.getuid())
    assert not preflight.path_state(str(tmp_path / "absent")).exists


def _import_result(stderr: str, returncode: int = 1, stdout: str = "") -> preflight.ImportResult:
    return preflight.ImportResult(returncode, stdout, stderr)


def test_pyacl_failures_are_told_apart_by_their_cause() -> None:
    refused = preflight.check_pyacl(
        _import_result("Traceback ...\nPermissionError: [Errno 13] Permission denied: '/usr/local/Ascend/x/acl.so'"),
        "",
    )
    assert "refused" in refused.problem and "usermod -a -G HwHiAiUser" in refused.fix
    missing = preflight.check_pyacl(_import_result("ModuleNotFoundError: No module named 'acl'"), "")
    assert "finds no module" in missing.problem and "set_env.sh" in missing.fix
    hidden = preflight.check_pyacl(_import_result("ModuleNotFoundError: No module named 'acl'"), "", cann_closed=True)
    assert "closed to this user" in hidden.problem and "HwHiAiUser" in hidden.fix
    library = preflight.check_pyacl(
        _import_result("ImportError: libascendcl.so: cannot open shared object file: No such file or directory"), ""
    )
    assert "cannot load a CANN library: ImportError: libascendcl.so" in library.problem
    assert "LD_LIBRARY_PATH" in library.fix
    assert "time limit" in preflight.check_pyacl(None, "").problem
    found = preflight.check_pyacl(_import_result("", 0, f"{HOME}/python/site-packages/acl.so\n"), str(FAKES))
    assert not found.problem and found.found == f"{HOME}/python/site-packages/acl.so"


def test_importing_the_simulator_is_a_problem() -> None:
    result = preflight.try_import_acl(sys.executable, _host_environment(PYTHONPATH=str(FAKES)))
    assert result is not None and result.returncode == 0, result
    check = preflight.check_pyacl(result, str(FAKES))
    assert "finds geserve's simulator" in check.problem
    nothing = preflight.try_import_acl(sys.executable, _host_environment())
    assert "ModuleNotFoundError" in preflight.check_pyacl(nothing, str(FAKES)).problem


def test_devices_visible_and_their_ids() -> None:
    two = {0: True, 1: True}
    assert not _problems(preflight.check_devices(two, True, None, "0,1"))
    assert "no /dev/davinciN" in preflight.check_devices({}, False, None, "0")[0].problem
    closed = preflight.check_devices({0: True, 1: False}, True, None, None)
    assert closed[0].problem == "no read/write on /dev/davinci1"
    assert "HwHiAiUser" in closed[0].fix
    assert "/dev/davinci_manager is missing" in preflight.check_devices(two, False, None, None)[0].problem


def test_visible_devices_take_logical_ids_and_bound_geserve_npu_devices() -> None:
    # A container given /dev/davinci4 and /dev/davinci5: logical ids 0 and 1; 5 cuts the list.
    chips = {4: True, 5: True}
    cut = preflight.check_devices(chips, True, "0,5", "0")
    assert [check.name for check in _problems(cut)] == ["ASCEND_RT_VISIBLE_DEVICES"]
    assert "leaving 1 device(s)" in cut[1].problem and "0..1" in cut[1].fix
    beyond = preflight.check_devices(chips, True, "1", "1")
    assert [check.name for check in _problems(beyond)] == ["GESERVE_NPU_DEVICES"]
    assert "beyond the 1 visible device(s)" in beyond[2].problem and "0..0" in beyond[2].fix
    assert not _problems(preflight.check_devices(chips, True, None, "1,0"))
    assert "not a list of ids" in preflight.check_devices(chips, True, None, "npu0")[-1].problem


@pytest.mark.parametrize(
    ("visible", "why"),
    [("1,0", "an id is lower than the one before it (0 after 1)"), ("0,0", "an id is listed twice (0)")],
)
def test_a_descending_or_repeated_id_hides_every_device(visible: str, why: str) -> None:
    checks = preflight.check_devices({0: True, 1: True}, True, visible, "0")
    assert [check.name for check in _problems(checks)] == ["ASCEND_RT_VISIBLE_DEVICES", "GESERVE_NPU_DEVICES"]
    assert checks[1].problem == (
        f"ASCEND_RT_VISIBLE_DEVICES='{visible}' hides every device: the runtime refuses the whole list when {why}"
    )
    assert checks[1].fix == "list each id once, in ascending order, from 0..1 (e.g. 0,1), or unset it"
    assert "beyond the 0 visible device(s)" in checks[2].problem


def test_visible_devices_are_read_without_stripping_spaces() -> None:
    """'0, 1' is device 0 alone: the runtime stops at the space (runtime.cc SplitString)."""
    checks = preflight.check_devices({0: True, 1: True}, True, "0, 1", "1")
    assert [check.name for check in _problems(checks)] == ["ASCEND_RT_VISIBLE_DEVICES", "GESERVE_NPU_DEVICES"]
    assert checks[1].problem == (
        "ASCEND_RT_VISIBLE_DEVICES='0, 1': the runtime stops at the first character other than a digit or a single "
        "comma (' 1'), leaving 1 device(s) (it takes logical ids, not /dev/davinciN numbers, and strips no spaces)"
    )
    assert not _problems(preflight.check_devices({0: True, 1: True}, True, "0,1 ", "1"))  # no id lost
    assert not _problems(preflight.check_devices({0: True, 1: True}, True, "0,1", "1"))
    held = preflight.check_devices({0: True, 1: True}, True, "0,1,1", "1")  # the runtime stops at two ids
    assert "stops once it holds as many ids as there are devices (2) ('1')" in held[1].problem


def test_device_files_are_the_numbered_chips(tmp_path: Path) -> None:
    for name in ("davinci0", "davinci3", "davinci_manager", "davinci-x", "devmm_svm"):
        (tmp_path / name).touch()
    assert preflight.device_files(str(tmp_path)) == ({0: True, 3: True}, True)
    assert preflight.device_files(str(tmp_path / "absent")) == ({}, False)


def test_the_om_must_be_named_exist_be_readable_and_be_an_om(tmp_path: Path) -> None:
    om = write_affine_om(tmp_path / "model.om", gears=[1, 2])
    check = preflight.check_model_file("GESERVE_NPU_OM", str(om), preflight.read_head(str(om)), preflight.OM_MAGICS)
    assert not check.problem
    unset = preflight.check_model_file("GESERVE_NPU_OM", None, None, preflight.OM_MAGICS)
    assert unset.problem == "GESERVE_NPU_OM is unset"
    absent = str(tmp_path / "absent.om")
    assert "is not a file" in preflight.check_model_file("GESERVE_NPU_OM", absent, None, preflight.OM_MAGICS).problem
    unreadable = preflight.check_model_file("GESERVE_NPU_OM", str(om), None, preflight.OM_MAGICS)
    assert "not readable by this user" in unreadable.problem
    onnx = tmp_path / "model.twin.onnx"
    assert onnx.is_file()  # written beside the .om by write_affine_om
    wrong = preflight.check_model_file("GESERVE_NPU_OM", str(onnx), preflight.read_head(str(onnx)), preflight.OM_MAGICS)
    assert "is not an ATC-compiled .om" in wrong.problem
    # The twin is optional and may hold anything.
    assert not preflight.check_model_file("GESERVE_NPU_ONNX", None, None, ()).problem
    assert not preflight.check_model_file("GESERVE_NPU_ONNX", str(onnx), preflight.read_head(str(onnx)), ()).problem


def test_on_this_machine_without_cann_it_lists_every_problem_and_fails(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--venv", str(tmp_path / "venv")],
        env=_host_environment(GESERVE_NPU_DEVICES="0"), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    problems = [line.removeprefix("PROBLEM  ").split(":")[0] for line in lines if line.startswith("PROBLEM")]
    assert {"set_env.sh", "CANN install", "pyACL", "GESERVE_NPU_OM"} <= set(problems), result.stdout
    if not any(name.startswith("davinci") for name in os.listdir("/dev")):
        assert "devices" in problems
    assert "ok       python: " in result.stdout
    assert lines[-1] == f"npu-check preflight: {len(problems)} problem(s), nothing was installed"


def _older_pythons() -> list[str]:
    """Python 3.6-3.10 interpreters on this machine that run (pyenv's shims exist for versions it will not start)."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = [shutil.which(f"python3.{minor}") for minor in range(6, 11)]
    candidates += [str(path) for path in sorted(pyenv.glob("3.*/bin/python3"))]
    found: dict[str, str] = {}
    for candidate in filter(None, candidates):
        probe = subprocess.run(
            [candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        version = probe.stdout.strip()
        if probe.returncode == 0 and version.startswith("3.") and int(version.split(".")[1]) < 11:
            found.setdefault(version, candidate)
    return list(found.values())


def test_an_older_python_runs_it_and_is_told_it_is_too_old(tmp_path: Path) -> None:
    pythons = _older_pythons()
    if not pythons:
        pytest.skip("no Python 3.6-3.10 on this machine")
    for python in pythons:
        result = subprocess.run(
            [python, str(SCRIPT), "--venv", str(tmp_path / "venv")],
            env=_host_environment(), capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert result.returncode == 1, (python, result.stderr)
        assert result.stdout.startswith("PROBLEM  python: geserve needs Python 3.11 or newer"), (python, result.stdout)
        assert "npu-check preflight:" in result.stdout, (python, result.stdout)


def _toolkit(root: Path, mode: int) -> dict[str, str]:
    """A toolkit tree with a stand-in `acl` module, its top directory at `mode`; set_env.sh's variables for it."""
    home = root / "Ascend" / "ascend-toolkit" / "latest"
    packages = home / "python" / "site-packages"
    packages.mkdir(parents=True)
    (packages / "acl.py").write_text("")
    for folder in (root, root / "Ascend", home, home / "python", packages):
        folder.chmod(0o755)
    (root / "Ascend" / "ascend-toolkit").chmod(mode)
    return {"ASCEND_TOOLKIT_HOME": str(home), "LD_LIBRARY_PATH": f"{home}/lib64", "PYTHONPATH": str(packages)}


@pytest.mark.skipif(os.geteuid() != 0, reason="starting the script as another user needs root")
def test_a_toolkit_closed_to_the_user_is_named_and_hides_pyacl_as_no_module() -> None:
    """As CANN installs it for its own group (mode 750), seen by a user outside that group: Python's finder skips a
    path entry it may not list, so `import acl` says no module although set_env.sh was sourced."""
    python = "/usr/bin/python3"
    if not os.access(python, os.X_OK) or not os.access(SCRIPT, os.R_OK):
        pytest.skip("no system python3 for another user to run")
    root = Path(tempfile.mkdtemp(prefix="geserve-cann-", dir="/tmp"))
    try:

        def run(environment: dict[str, str]) -> str:
            result = subprocess.run(
                [python, str(SCRIPT), "--venv", str(root / "venv")], env=_host_environment(**environment),
                user="nobody", group=grp.getgrgid(pwd.getpwnam("nobody").pw_gid).gr_name, extra_groups=[],
                cwd=root, capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
            assert result.returncode == 1, result.stderr
            return result.stdout

        closed = run(_toolkit(root, 0o750))
        toolkit = root / "Ascend" / "ascend-toolkit"
        assert (
            f"PROBLEM  CANN install: {toolkit} (owner root, group root, mode drwxr-x---) is closed to user nobody, "
            f"who is not in group root -- fix: open it to this user (`sudo chmod o+rx {toolkit}`)"
        ) in closed
        assert "PROBLEM  pyACL: `import acl` finds no module, as CANN's directories are closed to this user" in closed
        opened = run(_toolkit(root / "open", 0o755))
        assert "ok       CANN install: " in opened
        assert f"ok       pyACL: {root}/open/Ascend/ascend-toolkit/latest/python/site-packages/acl.py" in opened
    finally:
        shutil.rmtree(root)


def _python3_reporting(folder: Path, report: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "python3"
    script.write_text(f"#!/bin/sh\necho '{report}'\n")
    script.chmod(0o755)
    return script


def test_atcs_python3_is_found_without_the_venv_and_its_missing_packages_named(tmp_path: Path) -> None:
    """The python3 ATC will run CANN's operator compiler in: geserve starts ATC with its venv off PATH, so the
    preflight looks past the venv (and an activated one) and asks the next python3 what it lacks."""
    venv_python = _python3_reporting(tmp_path / "venv" / "bin", '{"executable": "venv"}')
    report = (
        '{"executable": "/usr/bin/python3", "version": [3, 10], "missing": ["decorator", "sympy"], "numpy": "1.24.4"}'
    )
    host_python = _python3_reporting(tmp_path / "host", report)
    environ = {"PATH": f"{venv_python.parent}{os.pathsep}{host_python.parent}", "VIRTUAL_ENV": str(tmp_path / "venv")}
    found = preflight.atc_python(environ, str(tmp_path / "venv"))
    assert found.path == str(host_python)
    check = preflight.check_atc_python("/usr/local/Ascend/cann/bin/atc", None, found)
    assert check.problem == f"{host_python} lacks decorator, sympy" and "--atc-python" in check.fix


@pytest.mark.parametrize(
    ("version", "numpy", "problem"),
    [([3, 11], "2.1.0", True), ([3, 13], "2.1.0", False), ([3, 11], "1.24.4", False)],
)
def test_numpy_2_under_atc_before_python_3_13_is_a_problem(version: list[int], numpy: str, problem: bool) -> None:
    report = {"executable": "/usr/bin/python3", "version": version, "missing": [], "numpy": numpy}
    check = preflight.check_atc_python("/bin/atc", None, preflight.AtcPython("/usr/bin/python3", report))
    assert bool(check.problem) == problem
    if problem:
        assert "needs numpy < 2" in check.problem


def test_no_atc_is_fine_unless_an_onnx_file_is_to_be_compiled() -> None:
    nothing = preflight.AtcPython(None, None)
    assert not preflight.check_atc_python(None, None, nothing).problem
    refused = preflight.check_atc_python(None, "/models/resnet.onnx", nothing)
    assert "atc is not on PATH" in refused.problem and "set_env.sh" in refused.fix
