"""`make npu-check`'s first step: says what this Ascend host lacks for the NPU tests, before anything is installed.

Standard library only, and nothing newer than Python 3.6 (Ubuntu 18.04's python3), so that whatever `python3` a
host has can run it and report that geserve needs 3.11. Every check prints one line, `ok` or `PROBLEM` with its
fix; the exit status is 1 when any check found a problem, after all of them ran.

Facts the checks rely on, and where they come from:
- CANN's installer makes HwHiAiUser the running user and group; a toolkit installed as root, or by a non-root
  user without --install-for-all, is for that user (and its group) only, so another user gets PermissionError
  or a failed `import acl` (CANN install guide, "Preparing Installation and Running Users":
  https://www.hiascend.com/document/detail/en/canncommercial/800/softwareinst/instg/instg_0004.html; the fix it
  gives for other users is `usermod -a -G HwHiAiUser <user>`).
- CANN's set_env.sh exports ASCEND_TOOLKIT_HOME and ASCEND_HOME_PATH, puts the toolkit's lib64 on LD_LIBRARY_PATH
  and its python/site-packages (where pyACL's `acl` lives) on PYTHONPATH. CANN 8.5 and newer install it as
  /usr/local/Ascend/cann/set_env.sh (CANN 8.5 docs, "安装后自动配置环境变量":
  https://www.hiascend.com/document/detail/zh/CANNCommunityEdition/850/maintenref/envvar/envref_07_0003.html;
  hicann/runtime README.md), older ones as /usr/local/Ascend/ascend-toolkit/set_env.sh (.../latest is the home).
- /dev/davinciN are the physical chips given to this host or container; ASCEND_RT_VISIBLE_DEVICES and geserve's
  --device-ids take logical ids 0..n-1 (shared/reference/pyacl.md, fact 3). The runtime reads the variable as
  hicann/runtime src/runtime/core/src/runtime.cc does (SplitString, Runtime::GetVisibleDevices): digits separated by
  single commas from the first character, nothing stripped, ending at any other character (a space too); it stops
  at the first id past the devices, and refuses the whole list, seeing no device at all, when an id is lower than
  the one before it or is listed twice.
"""

import argparse
import grp
import os
import pwd
import re
import stat
import subprocess
import sys
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

REQUIRED_PYTHON = (3, 11)
REQUIRED = "3.11"
ASCEND_ROOT = "/usr/local/Ascend"
# Where CANN installs its toolkit and set_env.sh: CANN 8.5 and newer first, then the older layout.
DEFAULT_TOOLKITS = ("/usr/local/Ascend/cann", "/usr/local/Ascend/ascend-toolkit/latest")
SET_ENVS = ("/usr/local/Ascend/cann/set_env.sh", "/usr/local/Ascend/ascend-toolkit/set_env.sh")
CANN_GROUP = "HwHiAiUser"
SOURCE_FIX = (
    "run `source " + SET_ENVS[0] + "` (CANN 8.5 and newer) or `source " + SET_ENVS[1] + "` (older CANN) in the "
    "shell that runs make"
)
GROUP_FIX = (
    "add this user to the " + CANN_GROUP + " group (`sudo usermod -a -G " + CANN_GROUP + " $USER`, then log in "
    "again or run `newgrp " + CANN_GROUP + "`), or reinstall the toolkit with --install-for-all"
)
# .om files: the v1 container's "IMOD" header, or the newest CANN's OM2 ZIP archive (shared/reference/om-format.md).
OM_MAGICS = (b"IMOD", b"PK\x03\x04")
_DEVICE_FILE = re.compile(r"^davinci(\d+)$")


class Check(NamedTuple):
    """One line of the report: `problem` is empty when the check passed."""

    name: str
    found: str
    problem: str = ""
    fix: str = ""

    def line(self) -> str:
        if not self.problem:
            return "ok       " + self.name + ": " + self.found
        return "PROBLEM  " + self.name + ": " + self.problem + " -- fix: " + self.fix


class PathState(NamedTuple):
    """What the current user may do with one path, and who owns it."""

    path: str
    exists: bool
    usable: bool  # directories: read and enter; files: read
    owner: str
    group: str
    mode: int


class ImportResult(NamedTuple):
    """`import acl` tried in a child interpreter: its exit status and what it printed."""

    returncode: int
    stdout: str
    stderr: str


# -- checks: pure functions of what was gathered ------------------------------------------------------------------


def check_python(version: Tuple[int, int, int], executable: str, make_variable: str = "PYTHON") -> Check:
    found = f"{version[0]}.{version[1]}.{version[2]} ({executable})"
    if tuple(version[:2]) >= REQUIRED_PYTHON:
        return Check("python", found)
    return Check(
        "python",
        found,
        f"geserve needs Python {REQUIRED} or newer, this is {found}",
        f"`make npu-check {make_variable}=python3.11` (any 3.11+ interpreter) picks the one the test venv is made from",
    )


def check_venv(pyvenv_cfg: Optional[str], venv: str) -> Optional[Check]:
    """An existing venv keeps the interpreter it was made with; None when there is no venv yet."""
    if pyvenv_cfg is None:
        return None
    version = None
    for line in pyvenv_cfg.splitlines():
        key, _, value = line.partition("=")
        if key.strip() in ("version", "version_info"):
            version = value.strip()
    if version is None:
        return Check("venv", venv, venv + "/pyvenv.cfg names no Python version", "remove " + venv + " and rerun")
    parts = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    if parts >= REQUIRED_PYTHON:
        return Check("venv", venv + " (Python " + version + ")")
    return Check(
        "venv",
        venv + " (Python " + version + ")",
        f"{venv} was made with Python {version}, geserve needs {REQUIRED}",
        "remove " + venv + " (`make clean`) and rerun with PYTHON=python3.11",
    )


def installed_set_env(isfile: Callable[[str], bool] = os.path.isfile) -> Optional[str]:
    """The set_env.sh this host has, the newest CANN's first; None when it has neither."""
    return next((path for path in SET_ENVS if isfile(path)), None)


def check_set_env(environ: Dict[str, str], installed: Optional[str] = None) -> List[Check]:
    """set_env.sh's variables: the toolkit home, its lib64 on LD_LIBRARY_PATH, its python/site-packages (pyACL) on
    PYTHONPATH. `installed`: the set_env.sh this host has (installed_set_env)."""
    home = environ.get("ASCEND_TOOLKIT_HOME") or environ.get("ASCEND_HOME_PATH")
    if not home:
        found = " (this host has " + installed + ")" if installed else ""
        return [
            Check(
                "set_env.sh",
                "",
                "ASCEND_TOOLKIT_HOME and ASCEND_HOME_PATH are unset: CANN's set_env.sh was not sourced" + found,
                SOURCE_FIX,
            )
        ]
    home = home.rstrip("/")
    checks = [Check("set_env.sh", "ASCEND_TOOLKIT_HOME=" + home)]
    # Older toolkits keep their libraries and pyACL elsewhere under the home (acllib/lib64, pyACL/python/...):
    # any directory of the toolkit will do, set_env.sh's usual one is what the message names.
    for variable, usual in (("LD_LIBRARY_PATH", home + "/lib64"), ("PYTHONPATH", home + "/python/site-packages")):
        entries = [entry.rstrip("/") for entry in environ.get(variable, "").split(":") if entry]
        ours = [entry for entry in entries if entry == home or entry.startswith(home + "/")]
        if ours:
            checks.append(Check(variable, "holds " + ours[0]))
        else:
            checks.append(Check(variable, "", f"{variable} holds no directory of {home} (such as {usual})", SOURCE_FIX))
    return checks


def check_cann_access(
    states: Sequence[PathState], user: str, groups: Sequence[str], listed_in: Sequence[str] = ()
) -> Check:
    """Every directory from /usr/local/Ascend down to pyACL must be readable and enterable by this user. `groups`:
    this process's groups; `listed_in`: the groups /etc/group lists the user in (joined since this login, if not
    in `groups`)."""
    if not states or not states[0].exists:
        return Check(
            "CANN install",
            "",
            "no CANN toolkit at " + (states[0].path if states else ASCEND_ROOT),
            "install the CANN toolkit (and NPU driver), or source the set_env.sh of where it is installed",
        )
    for state in states:
        if not state.exists:
            return Check(
                "CANN install",
                "",
                state.path + " does not exist: the toolkit is not installed there",
                "install the CANN toolkit, or source the set_env.sh of the one installed",
            )
        if not state.usable:
            member = "is" if state.group in groups else "is not"
            if state.group in listed_in and state.group not in groups:
                member = "was added to group " + state.group + " after this login, so is not"
                fix = "log in again, or run `newgrp " + state.group + "` in the shell that runs make"
            elif state.group == CANN_GROUP and state.group not in groups:
                fix = GROUP_FIX
            else:
                fix = f"open it to this user (`sudo chmod o+rx {state.path}`), or reinstall CANN with --install-for-all"
            return Check(
                "CANN install",
                "",
                f"{state.path} (owner {state.owner}, group {state.group}, mode {stat.filemode(state.mode)}) is "
                f"closed to user {user}, who {member} in group {state.group}",
                fix,
            )
    return Check("CANN install", states[-1].path + " readable by " + user)


def check_pyacl(result: Optional[ImportResult], fakes: str, cann_closed: bool = False) -> Check:
    """Why `import acl` failed in a child interpreter, or where it came from. `cann_closed`: a directory on the way
    to pyACL is closed to this user, which Python reports as no module at all (its finder skips a path entry it
    may not list)."""
    if result is None:
        return Check("pyACL", "", "`import acl` did not finish within its time limit", "check the CANN install")
    output = result.stderr.strip().splitlines()
    last = output[-1] if output else f"exit status {result.returncode}"
    if result.returncode == 0:
        origin = result.stdout.strip()
        if fakes and origin.startswith(fakes.rstrip("/") + "/"):
            return Check(
                "pyACL", "", f"`import acl` finds geserve's simulator {origin}", "take tests/fakes off PYTHONPATH"
            )
        return Check("pyACL", origin)
    if "PermissionError" in result.stderr or "Permission denied" in result.stderr:
        return Check("pyACL", "", "`import acl` is refused: " + last, GROUP_FIX)
    if "ModuleNotFoundError" in result.stderr and cann_closed:
        return Check(
            "pyACL", "", "`import acl` finds no module, as CANN's directories are closed to this user", GROUP_FIX
        )
    if "ModuleNotFoundError" in result.stderr:
        return Check("pyACL", "", "`import acl` finds no module: " + last, SOURCE_FIX)
    if ".so" in result.stderr:
        return Check(
            "pyACL",
            "",
            "`import acl` cannot load a CANN library: " + last,
            SOURCE_FIX + " (it puts the toolkit's lib64 and the driver's libraries on LD_LIBRARY_PATH)",
        )
    return Check("pyACL", "", "`import acl` failed: " + last, "check the CANN install against this Python version")


# What CANN's operator compiler (TBE), which ATC runs in the `python3` on its PATH, imports; before Python 3.13 it
# needs numpy < 2 (geserve's geserve/atc/python_env.py holds the same list).
ATC_PACKAGES = ("numpy", "decorator", "attrs", "psutil", "scipy", "sympy")
_ATC_PROBE = (
    "import importlib.util, json, sys\n"
    "missing = [m for m in " + repr(ATC_PACKAGES) + " if importlib.util.find_spec(m) is None]\n"
    "numpy = ''\n"
    "if 'numpy' not in missing:\n"
    "    import numpy\n"
    "    numpy = numpy.__version__\n"
    "print(json.dumps({'executable': sys.executable, 'version': list(sys.version_info[:2]), 'missing': missing,"
    " 'numpy': numpy}))\n"
)


class AtcPython(NamedTuple):
    """The `python3` ATC would run its operator compiler in, as it reported itself (None: it did not answer)."""

    path: Optional[str]
    report: Optional[Dict[str, object]]


def check_atc_python(atc: Optional[str], onnx: Optional[str], found: AtcPython) -> Check:
    """The interpreter ATC finds (geserve starts ATC without its venv on PATH) has what CANN's operator compiler
    imports; only where something will be compiled (atc on PATH, or GESERVE_NPU_ONNX to compile)."""
    if atc is None:
        if onnx:
            return Check(
                "ATC's python3", "", "GESERVE_NPU_ONNX is set but atc is not on PATH to compile it", SOURCE_FIX
            )
        return Check("ATC's python3", "no atc on PATH: nothing is compiled")
    if found.path is None:
        return Check("ATC's python3", "", "ATC finds no python3 on PATH", "install python3 with CANN's packages")
    if found.report is None:
        return Check("ATC's python3", "", found.path + " does not start", "check that interpreter")
    missing = [str(name) for name in found.report.get("missing", [])]  # type: ignore[attr-defined]
    version = tuple(found.report.get("version", [0, 0]))  # type: ignore[arg-type]
    numpy = str(found.report.get("numpy") or "")
    fix = (
        "pip install the packages CANN needs into "
        + found.path
        + " (numpy<2 before Python 3.13), or start geserve with --atc-python naming one that has them"
    )
    if missing:
        return Check("ATC's python3", "", found.path + " lacks " + ", ".join(missing), fix)
    if numpy and int(numpy.split(".", 1)[0]) >= 2 and version < (3, 13):
        return Check(
            "ATC's python3", "", found.path + " has numpy " + numpy + "; CANN's operator compiler needs numpy < 2", fix
        )
    return Check("ATC's python3", found.path + " (numpy " + numpy + ")")


class VisibleIds(NamedTuple):
    """ASCEND_RT_VISIBLE_DEVICES as the runtime reads it: the ids it keeps, the rest of the value (which it ignores)
    and where the runtime stopped; or, when it refuses the whole list, why (`refused`), and no ids."""

    kept: List[int]
    rest: str
    stop: str = ""
    refused: str = ""


_VISIBLE_READ = re.compile(r"[0-9]+(?:,[0-9]+)*,?")


def read_visible(value: str, count: int) -> VisibleIds:
    """runtime.cc's SplitString and Runtime::GetVisibleDevices on a host of `count` devices: ASCII digits
    separated by single commas from the first character, nothing stripped; ids past the devices (or past INT_MAX,
    which std::stoi cannot read) end the list, as does holding `count` ids; an id lower than the one before it or
    listed twice refuses it whole."""
    read = _VISIBLE_READ.match(value)
    ids = list(re.finditer(r"[0-9]+", read.group())) if read else []
    kept = []  # type: List[int]
    for position, match in enumerate(ids):
        number = int(match.group())
        if number >= count or number > 2**31 - 1:
            return VisibleIds(kept, value[match.start() :], f"stops at its first id outside 0..{count - 1}")
        if kept and number < kept[-1]:
            refused = f"an id is lower than the one before it ({match.group()} after {kept[-1]})"
            return VisibleIds([], "", "", refused)
        if number in kept:
            return VisibleIds([], "", "", f"an id is listed twice ({match.group()})")
        kept.append(number)
        if len(kept) >= count and position + 1 < len(ids):
            stop = f"stops once it holds as many ids as there are devices ({count})"
            return VisibleIds(kept, value[ids[position + 1].start() :], stop)
    rest = value[read.end() :] if read else value
    return VisibleIds(kept, rest, "stops at the first character other than a digit or a single comma" if rest else "")


def parse_ids(text: str) -> Optional[List[int]]:
    """`0,1,3`; None when an entry is not a number."""
    entries = [entry.strip() for entry in text.split(",") if entry.strip()]
    if not all(entry.isdigit() for entry in entries):
        return None
    return [int(entry) for entry in entries]


def check_devices(chips: Dict[int, bool], manager: bool, visible: Optional[str], wanted: Optional[str]) -> List[Check]:
    """`chips`: /dev/davinciN number -> usable (read and write) by this user; `visible`: ASCEND_RT_VISIBLE_DEVICES;
    `wanted`: GESERVE_NPU_DEVICES."""
    if not chips:
        return [
            Check(
                "devices",
                "",
                "no /dev/davinciN: the NPU driver is not loaded, or this container was given no NPU",
                "install the driver (`npu-smi info` lists the chips); in a container pass --device=/dev/davinciN "
                "--device=/dev/davinci_manager --device=/dev/devmm_svm --device=/dev/hisi_hdc",
            )
        ]
    names = ", ".join(f"/dev/davinci{number}" for number in sorted(chips))
    checks = []
    closed = [number for number in sorted(chips) if not chips[number]]
    if closed:
        checks.append(
            Check(
                "devices",
                names,
                "no read/write on " + ", ".join(f"/dev/davinci{number}" for number in closed),
                GROUP_FIX.replace(", or reinstall the toolkit with --install-for-all", ""),
            )
        )
    elif not manager:
        checks.append(Check("devices", names, "/dev/davinci_manager is missing", "pass --device=/dev/davinci_manager"))
    else:
        checks.append(Check("devices", names))
    count = len(chips)
    if visible is not None:
        read = read_visible(visible, count)
        if read.refused:
            checks.append(
                Check(
                    "ASCEND_RT_VISIBLE_DEVICES",
                    visible,
                    f"ASCEND_RT_VISIBLE_DEVICES='{visible}' hides every device: the runtime refuses the whole list "
                    f"when {read.refused}",
                    f"list each id once, in ascending order, from 0..{count - 1} (e.g. 0,1), or unset it",
                )
            )
        elif re.search("[0-9]", read.rest):  # an id the runtime does not read (a trailing space loses none)
            checks.append(
                Check(
                    "ASCEND_RT_VISIBLE_DEVICES",
                    visible,
                    f"ASCEND_RT_VISIBLE_DEVICES='{visible}': the runtime {read.stop} ('{read.rest}'), "
                    f"leaving {len(read.kept)} device(s) (it takes logical ids, not /dev/davinciN numbers, and strips "
                    "no spaces)",
                    f"list ids from 0..{count - 1} separated by commas alone (e.g. 0,1), or unset it",
                )
            )
        else:
            checks.append(Check("ASCEND_RT_VISIBLE_DEVICES", visible))
        count = len(read.kept)
    if wanted is not None:
        ids = parse_ids(wanted)
        if ids is None or not ids:
            checks.append(
                Check("GESERVE_NPU_DEVICES", wanted, f"GESERVE_NPU_DEVICES={wanted} is not a list of ids", "e.g. 0,1")
            )
        elif max(ids) >= count:
            checks.append(
                Check(
                    "GESERVE_NPU_DEVICES",
                    wanted,
                    f"GESERVE_NPU_DEVICES={wanted} names logical ids beyond the {count} visible device(s)",
                    f"use ids from 0..{count - 1}" if count else "make a device visible first",
                )
            )
        else:
            checks.append(Check("GESERVE_NPU_DEVICES", wanted))
    return checks


def check_model_file(variable: str, path: Optional[str], head: Optional[bytes], magics: Sequence[bytes]) -> Check:
    """`head`: the file's first bytes, None when it could not be read; empty `magics`: any content will do."""
    if not path:
        if variable == "GESERVE_NPU_OM":
            return Check(variable, "", "GESERVE_NPU_OM is unset", "make npu-check GESERVE_NPU_OM=/path/to/model.om")
        return Check(variable, "unset (outputs are checked for shape and finiteness only)")
    if not os.path.isfile(path):
        return Check(
            variable,
            path,
            path + " is not a file",
            f"point {variable} at the file (relative paths start at the repository)",
        )
    if head is None:
        return Check(variable, path, path + " is not readable by this user", "chmod o+r, or copy it somewhere readable")
    if magics and not any(head.startswith(magic) for magic in magics):
        return Check(
            variable,
            path,
            f"{path} is not an ATC-compiled .om (it starts with {head[:8]!r})",
            "compile the model with `atc --framework=5 --model=... --output=...`",
        )
    return Check(variable, path)


# -- gathering: what this host has ----------------------------------------------------------------------------------


def path_state(path: str) -> PathState:
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return PathState(path, False, False, "", "", 0)
    except OSError:
        return PathState(path, True, False, "?", "?", 0)
    wanted = os.R_OK | (os.X_OK if stat.S_ISDIR(info.st_mode) else 0)
    return PathState(
        path, True, os.access(path, wanted), _user_name(info.st_uid), _group_name(info.st_gid), info.st_mode
    )


def cann_paths(environ: Dict[str, str], isdir: Callable[[str], bool] = os.path.isdir) -> List[str]:
    """/usr/local/Ascend (or wherever the toolkit home is), down to the toolkit's python/site-packages. Without
    set_env.sh's variables, the home of the newest CANN layout this host has, else the older one's."""
    default = next((path for path in DEFAULT_TOOLKITS if isdir(path)), DEFAULT_TOOLKITS[-1])
    home = (environ.get("ASCEND_TOOLKIT_HOME") or environ.get("ASCEND_HOME_PATH") or default).rstrip("/")
    target = home + "/python/site-packages"
    root = ASCEND_ROOT if (home + "/").startswith(ASCEND_ROOT + "/") else os.path.dirname(home)
    paths = [root]
    for part in target[len(root) :].strip("/").split("/"):
        paths.append(paths[-1] + "/" + part)
    return paths


def try_import_acl(executable: str, environ: Dict[str, str], timeout_s: float = 60) -> Optional[ImportResult]:
    command = [executable, "-c", "import acl, os; print(os.path.realpath(acl.__file__))"]
    try:
        # capture_output and text came with 3.7; this runs on 3.6 too.
        done = subprocess.run(  # noqa: UP022
            command,
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            universal_newlines=True,  # noqa: UP021
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None
    return ImportResult(done.returncode, done.stdout, done.stderr)


def atc_python(environ: Dict[str, str], venv: str, timeout_s: float = 60) -> AtcPython:
    """The `python3` on PATH once geserve's venv (and any activated one) is off it, as geserve starts ATC, and what
    it reports."""
    import json
    import shutil

    ours = {os.path.realpath(os.path.join(path, "bin")) for path in (venv, environ.get("VIRTUAL_ENV", "")) if path}
    entries = [
        entry for entry in environ.get("PATH", "").split(os.pathsep) if entry and os.path.realpath(entry) not in ours
    ]
    path = shutil.which("python3", path=os.pathsep.join(entries))
    if path is None:
        return AtcPython(None, None)
    env = dict(environ, PATH=os.pathsep.join(entries))
    env.pop("VIRTUAL_ENV", None)
    try:
        done = subprocess.run(  # noqa: UP022 (Python 3.6 has no capture_output)
            [path, "-c", _ATC_PROBE],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            universal_newlines=True,  # noqa: UP021 (nor text=)
            env=env,
            timeout=timeout_s,
            check=False,
        )
        return AtcPython(path, json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None)
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return AtcPython(path, None)


def device_files(dev: str = "/dev") -> Tuple[Dict[int, bool], bool]:
    try:
        entries = os.listdir(dev)
    except OSError:
        return {}, False
    chips = {}
    for entry in entries:
        match = _DEVICE_FILE.match(entry)
        if match:
            chips[int(match.group(1))] = os.access(os.path.join(dev, entry), os.R_OK | os.W_OK)
    return chips, "davinci_manager" in entries


def read_head(path: Optional[str], size: int = 8) -> Optional[bytes]:
    if not path:
        return None
    try:
        with open(path, "rb") as stream:
            return stream.read(size)
    except OSError:
        return None


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def run_checks(
    environ: Dict[str, str], venv: str, fakes: str, import_acl: Callable[[], Optional[ImportResult]]
) -> List[Check]:
    version = sys.version_info
    checks = [check_python((version[0], version[1], version[2]), sys.executable)]
    pyvenv = None
    try:
        with open(os.path.join(venv, "pyvenv.cfg")) as stream:
            pyvenv = stream.read()
    except OSError:
        pass
    venv_check = check_venv(pyvenv, venv)
    if venv_check is not None:
        checks.append(venv_check)
    checks.extend(check_set_env(environ, installed_set_env()))
    user = _user_name(os.getuid())
    groups = [_group_name(gid) for gid in os.getgroups()]
    listed_in = [entry.gr_name for entry in grp.getgrall() if user in entry.gr_mem]
    access = check_cann_access([path_state(path) for path in cann_paths(environ)], user, groups, listed_in)
    checks.append(access)
    checks.append(check_pyacl(import_acl(), fakes, cann_closed="closed to user" in access.problem))
    chips, manager = device_files()
    checks.extend(
        check_devices(
            chips, manager, environ.get("ASCEND_RT_VISIBLE_DEVICES"), environ.get("GESERVE_NPU_DEVICES") or None
        )
    )
    import shutil

    atc = shutil.which("atc", path=environ.get("PATH", ""))
    onnx_to_compile = environ.get("GESERVE_NPU_ONNX")
    checks.append(check_atc_python(atc, onnx_to_compile, atc_python(environ, venv) if atc else AtcPython(None, None)))
    om = environ.get("GESERVE_NPU_OM")
    checks.append(check_model_file("GESERVE_NPU_OM", om, read_head(om), OM_MAGICS))
    onnx = environ.get("GESERVE_NPU_ONNX")
    checks.append(check_model_file("GESERVE_NPU_ONNX", onnx, read_head(onnx), ()))
    return checks


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", default=".venv", help="the venv `make npu-check` installs into (default: .venv)")
    args = parser.parse_args(argv)
    environ = dict(os.environ)
    fakes = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fakes")
    checks = run_checks(environ, args.venv, fakes, lambda: try_import_acl(sys.executable, environ))
    for check in checks:
        print(check.line())
    problems = [check for check in checks if check.problem]
    if problems:
        print(f"npu-check preflight: {len(problems)} problem(s), nothing was installed")
        return 1
    print("npu-check preflight: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
