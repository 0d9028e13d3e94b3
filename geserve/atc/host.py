"""What this host offers for compiling and running `.om` models: ATC, pyACL, its chip and its CANN version."""

from __future__ import annotations

import importlib.machinery
import logging
import os
import platform
import shutil
import sys
from pathlib import Path

from geserve import helper_process
from geserve.errors import ModelLoadError

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 60.0
# acl.get_soc_name() names the chip ATC's --soc_version wants (pyacl.md §1.1); it needs no acl.init and
# returns None on failure (CANN API reference, "函数:get_soc_name": 约束说明 无). Asked in a child process so
# the server itself never imports pyACL (DESIGN: backends load only inside workers).
_SOC_PROBE = "import acl; print(acl.get_soc_name() or '')"
_HOME_VARIABLES = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")


# What a host with Ascend NPUs has even where CANN is not set up: the driver's device files (/dev/davinciN per chip,
# /dev/davinci_manager) and the driver's install folder (the driver package's default, which the device plugin and
# the Ascend Docker runtime mount into a container).
DRIVER_HOME = Path("/usr/local/Ascend/driver")


def ascend_driver(dev: Path = Path("/dev"), driver_home: Path = DRIVER_HOME) -> str | None:
    """What shows this host has the Ascend driver (its device files or its install folder), or None: a host without
    it has no NPU, whatever else is installed."""
    try:
        chips = sorted(entry.name for entry in dev.iterdir() if entry.name.startswith("davinci"))
    except OSError:
        chips = []
    if chips:
        return ", ".join(f"{dev}/{chip}" for chip in chips)
    if driver_home.is_dir():
        return str(driver_home)
    return None


def find_atc() -> str | None:
    return shutil.which("atc")


def has_pyacl() -> bool:
    """Whether a worker's `import acl` would find pyACL (CANN's set_env.sh puts it on PYTHONPATH), found without
    importing it: the workers start with this process's sys.path. The path finder, not importlib.util.find_spec,
    which answers from sys.modules."""
    return importlib.machinery.PathFinder.find_spec("acl", sys.path) is not None


def soc_name(timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """The host's chip as ATC's --soc_version takes it, e.g. Ascend310P3; raises ModelLoadError."""
    try:
        done = helper_process.run(
            [sys.executable, "-c", _SOC_PROBE], timeout_s, what="the chip probe (acl.get_soc_name)"
        )
    except helper_process.ExpiredError:
        raise ModelLoadError(f"asking pyACL for the chip name (acl.get_soc_name) took over {timeout_s:g}s") from None
    except OSError as error:
        raise ModelLoadError(f"cannot ask pyACL for the chip name: {error}") from None
    name = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if done.returncode != 0 or not name:
        tail = done.stderr.strip().splitlines()[-1:] or ["no name"]
        raise ModelLoadError(f"cannot ask pyACL for the chip name (acl.get_soc_name): {tail[0]}")
    return name


def cann_version(environ: dict[str, str] | None = None, atc: str | None = None) -> str:
    """The toolkit's version as CANN records it at install: `version=` in
    `<ASCEND_HOME_PATH>/<arch>-linux/ascend_toolkit_install.info` (CANN install guide, "File Paths"),
    else `Version=` in `<home>/compiler/version.info`. Without those variables (set_env.sh not sourced) the
    toolkit is found from the `atc` binary: `<toolkit>/<version>/bin/atc` or `.../compiler/bin/atc`. "unknown",
    with a warning, when neither tells: the key then cannot see a CANN upgrade."""
    env = os.environ if environ is None else environ
    homes = [Path(home) for home in (env.get(variable) for variable in _HOME_VARIABLES) if home]
    if atc:
        binary = Path(atc).resolve()  # ascend-toolkit/latest is a link to the version folder
        homes += [binary.parent.parent, binary.parent.parent.parent]
    for home in homes:
        version = _installed_version(home)
        if version:
            return version
    logger.warning(
        "the CANN version is unknown (neither ASCEND_HOME_PATH/ASCEND_TOOLKIT_HOME nor the folders around atc "
        "hold ascend_toolkit_install.info or compiler/version.info): source CANN's set_env.sh, or compiled models "
        "are not recompiled after a CANN upgrade"
    )
    return "unknown"


def opp_version(environ: dict[str, str] | None = None, atc: str | None = None) -> str:
    """The operator package's version (`Version=` in `<opp>/version.info`, the OPP package's record of itself; the
    kernels package installs into the same folder): `ASCEND_OPP_PATH`, which set_env.sh exports, else the `opp`
    folder beside the toolkit's `compiler`. "" when neither tells."""
    env = os.environ if environ is None else environ
    folders = [Path(env["ASCEND_OPP_PATH"])] if env.get("ASCEND_OPP_PATH") else []
    homes = [Path(home) for home in (env.get(variable) for variable in _HOME_VARIABLES) if home]
    if atc:
        binary = Path(atc).resolve()
        homes += [binary.parent.parent, binary.parent.parent.parent]
    folders += [home / "opp" for home in homes]
    for folder in folders:
        version = _read_key(folder / "version.info", "Version")
        if version:
            return version
    return ""


def _installed_version(home: Path) -> str:
    arch = platform.machine()
    for path, key in (
        (home / f"{arch}-linux" / "ascend_toolkit_install.info", "version"),
        (home / "ascend_toolkit_install.info", "version"),
        (home / "compiler" / "version.info", "Version"),
    ):
        version = _read_key(path, key)
        if version:
            return version
    return ""


def _read_key(path: Path, key: str) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in lines:
        name, sep, value = line.partition("=")
        if sep and name.strip() == key:
            return value.strip()
    return ""
