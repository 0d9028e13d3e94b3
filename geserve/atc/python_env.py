"""The environment ATC runs in, and whether the `python3` it finds there can run CANN's operator compiler."""

# ATC compiles operators with TBE, CANN's Python operator compiler, in the interpreter it finds as `python3` on PATH
# (`python3-config --prefix`, then an embedded interpreter; GE's atc wrapper and TBE's `te_fusion` start it that
# way). Started from geserve's own virtual environment that would be geserve's interpreter, with its numpy 2 and
# protobuf 6 and none of what CANN needs; so ATC gets the host's environment without ours, or an interpreter the
# user names (--atc-python).

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from geserve import helper_process

PROBE_TIMEOUT_S = 60.0
# What TBE imports (CANN installation guide, "安装依赖" / installing the Python dependencies: attrs, decorator,
# numpy, psutil, scipy, sympy are the ones the operator compiler cannot start without).
NEEDED_PACKAGES = ("numpy", "decorator", "attrs", "psutil", "scipy", "sympy")
# Before Python 3.13 CANN's TBE is built against numpy 1.x (the ascendai/cann images pin numpy 1.24).
NUMPY_2_FROM_PYTHON = (3, 13)
_PROBE = """
import importlib.util, json, sys
needed = {needed!r}
missing = [name for name in needed if importlib.util.find_spec(name) is None]
numpy = ""
if "numpy" not in missing:
    import numpy
    numpy = numpy.__version__
print(json.dumps({{"executable": sys.executable, "prefix": sys.prefix, "version": list(sys.version_info[:3]),
                   "missing": missing, "numpy": numpy}}))
"""


def _own_virtual_env() -> str | None:
    return sys.prefix if sys.prefix != sys.base_prefix else None


def atc_environment(
    python: str | None = None,
    environ: Mapping[str, str] | None = None,
    own_virtual_env: str | None = None,
) -> dict[str, str]:
    """The environment ATC runs in: this process's (`environ`), without its virtual environment (`own_virtual_env`,
    by default the one this interpreter runs in: VIRTUAL_ENV unset, its `bin` off PATH), and with `python` (when
    given) as the `python3` first on PATH."""
    env = dict(os.environ if environ is None else environ)
    venv = own_virtual_env or _own_virtual_env()
    ours = set()
    if venv:
        ours.add(_same(Path(venv) / "bin"))
    virtual_env = env.pop("VIRTUAL_ENV", "")
    if virtual_env:
        ours.add(_same(Path(virtual_env) / "bin"))
    env.pop("VIRTUAL_ENV_PROMPT", None)
    paths = [entry for entry in env.get("PATH", "").split(os.pathsep) if entry and _same(Path(entry)) not in ours]
    if python:
        paths.insert(0, str(_interpreter_folder(python)))
    env["PATH"] = os.pathsep.join(paths)
    return env


def _same(path: Path) -> Path:
    try:
        return path.resolve()
    except OSError:
        return path


@functools.cache
def _interpreter_folder(python: str) -> Path:
    """A private folder whose `python3` (and `python3-config`, where the interpreter has one beside it) is
    `python`: ATC looks for those names."""
    folder = Path(tempfile.mkdtemp(prefix="geserve-atc-python-"))
    atexit.register(shutil.rmtree, folder, True)
    interpreter = Path(python).absolute()
    (folder / "python3").symlink_to(interpreter)
    config = interpreter.with_name(f"{interpreter.name}-config")
    if config.exists():
        (folder / "python3-config").symlink_to(config)
    return folder


@dataclass(frozen=True, slots=True)
class AtcPython:
    """The `python3` ATC finds, as it reports itself; `problems` say what would stop CANN's operator compiler."""

    executable: str
    problems: tuple[str, ...]


def check_atc_python(env: Mapping[str, str], timeout_s: float = PROBE_TIMEOUT_S) -> AtcPython:
    """Ask the `python3` on `env`'s PATH what it is and which of CANN's packages it lacks."""
    python3 = shutil.which("python3", path=env.get("PATH", ""))
    if python3 is None:
        return AtcPython("", ("ATC finds no python3 on its PATH (CANN's operator compiler runs in it)",))
    try:
        done = helper_process.run(
            [python3, "-c", _PROBE.format(needed=NEEDED_PACKAGES)], timeout_s, env, what="ATC's python3"
        )
        report = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 and done.stdout else None
    except (helper_process.ExpiredError, OSError, ValueError, IndexError):
        report = None
    if not isinstance(report, dict):
        return AtcPython(python3, (f"ATC's python3 ({python3}) does not start",))
    return AtcPython(str(report["executable"]), tuple(_problems(report)))


def _problems(report: dict[str, Any]) -> list[str]:
    executable, prefix = str(report["executable"]), str(report["prefix"])
    version = tuple(int(part) for part in report["version"])
    missing = [str(name) for name in report["missing"]]
    problems = []
    own = _own_virtual_env()
    if own is not None and _same(Path(prefix)) == _same(Path(own)):
        problems.append(f"ATC's python3 ({executable}) is geserve's own virtual environment")
    if missing:
        problems.append(
            f"ATC's python3 ({executable}) lacks {', '.join(missing)}, which CANN's operator compiler imports: "
            f"install them into that interpreter, or name one that has them with --atc-python"
        )
    numpy = str(report["numpy"])
    if numpy and int(numpy.split(".", maxsplit=1)[0]) >= 2 and version[:2] < NUMPY_2_FROM_PYTHON:
        problems.append(
            f"ATC's python3 ({executable}, Python {'.'.join(map(str, version))}) has numpy {numpy}; CANN's operator "
            "compiler needs numpy < 2 before Python 3.13"
        )
    return problems
