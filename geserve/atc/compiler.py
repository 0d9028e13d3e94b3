"""Compiles one model version's ONNX file with ATC into the cache, or finds it there."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from geserve._generated import model_config_pb2 as mc
from geserve.atc import cache, chips, command, graph_inputs, options
from geserve.atc.python_env import atc_environment, check_atc_python
from geserve.errors import ModelLoadError

logger = logging.getLogger(__name__)

# A large model takes ATC many minutes; a hung one must still fail the load.
COMPILE_TIMEOUT_S = 3600.0
TIMEOUT_PARAMETER = "atc_timeout_s"  # a config parameter: this model's limit, in seconds
OP_CACHE = ".atc_op_cache"  # ATC's compiled-operator cache, inside the model cache
_TAIL_LINES = 15
_POLL_S = 0.2  # how often a waiting compile looks for a cancel
_REAP_S = 5.0  # for a killed ATC to exit
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Running ATC processes, so a stopping server can kill them; set once it is stopping.
_RUNNING: set[subprocess.Popen[bytes]] = set()
_RUNNING_LOCK = threading.Lock()
_PRCTL = ctypes.CDLL(None).prctl if sys.platform == "linux" else None
_STOPPING = threading.Event()


@dataclass(frozen=True, slots=True)
class Compiled:
    om: Path
    compiled: bool  # False: found in the cache
    argv: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Toolchain:
    """The host's ATC and what the cache key needs of the host."""

    atc: str
    soc: str
    cann: str
    cache_dir: Path
    timeout_s: float = COMPILE_TIMEOUT_S
    python: str | None = None  # --atc-python: the interpreter ATC's operator compiler runs in (else the host's)
    opp: str = ""  # the operator package's version


def compile_version(
    config: mc.ModelConfig, onnx: Path, model_dir: Path, tools: Toolchain, cancel: threading.Event | None = None
) -> Compiled:
    """The cached `.om` for this ONNX file, config and host, compiling it first when it is not there; setting
    `cancel` (a load given up) kills the ATC run."""
    onnx, described, parsed = _described(config, onnx, model_dir)
    tools = dataclasses.replace(tools, cache_dir=tools.cache_dir.absolute())
    atc_command, folder = _entry(config.name, onnx, described, parsed, tools, soc=tools.soc)
    timeout_s = time_limit(config, tools.timeout_s)
    # ATC keeps compiled operators in --op_compiler_cache_dir, by default $HOME/atc_data (ATC docs,
    # --op_compiler_cache_dir), which a container's HOME may not allow: under our cache unless the config says.
    # It changes how long ATC takes, never the .om, so it stays out of the key.
    extra = (
        ()
        if any(o.flag == "op_compiler_cache_dir" for o in parsed)
        else (f"--op_compiler_cache_dir={tools.cache_dir / OP_CACHE}",)
    )
    with _cache_errors(config.name, tools.cache_dir):
        found = cache.lookup(folder)
    if found is not None:
        argv = (*atc_command.argv(tools.atc, onnx, folder / "model"), *extra)
        logger.info("model '%s': using the cached compile of '%s' (%s)", config.name, onnx, found)
        return Compiled(found, False, argv)
    with _cache_errors(config.name, tools.cache_dir):
        # Another server's compile may have a longer limit than this model's: never sweep within the default's.
        staged = cache.staging(tools.cache_dir, 2 * max(timeout_s, tools.timeout_s, COMPILE_TIMEOUT_S))
    try:
        argv = (*atc_command.argv(tools.atc, onnx, staged / "model"), *extra)
        logger.info("model '%s': compiling '%s' with ATC: %s", config.name, onnx, shlex.join(argv))
        _run(config.name, argv, staged, timeout_s, cancel, env=atc_environment(tools.python))
        with _cache_errors(config.name, tools.cache_dir):
            if cache.lookup(staged) is None:
                raise ModelLoadError(f"model '{config.name}': ATC exited 0 but wrote no '{staged / cache.MODEL_FILE}'")
            (staged / "atc_command.txt").write_text(shlex.join(argv) + "\n")
            om = cache.publish(staged, folder)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    logger.info("model '%s': compiled '%s' into '%s'", config.name, onnx, om)
    return Compiled(om, True, argv)


def find_compiled(config: mc.ModelConfig, onnx: Path, model_dir: Path, tools: Toolchain) -> Compiled | None:
    """A cached `.om` of this ONNX file and config for the host's chip or, failing that, for a chip of its family
    (which the runtime loads just as well); None when the cache holds neither. For a host that cannot compile (no
    `atc` in the image): an entry `geserve compile` made for a sibling chip serves rather than nothing."""
    onnx, described, parsed = _described(config, onnx, model_dir)
    tools = dataclasses.replace(tools, cache_dir=tools.cache_dir.absolute())
    for soc in (tools.soc, *chips.siblings(tools.soc)):
        atc_command, folder = _entry(config.name, onnx, described, parsed, tools, soc=soc)
        with _cache_errors(config.name, tools.cache_dir):
            found = cache.lookup(folder)
        if found is None:
            continue
        if soc != tools.soc:
            logger.warning(
                "model '%s': no compile of '%s' for %s in the cache and no atc to make one: serving the one made for "
                "%s, a chip of the same architecture (%s)",
                config.name, onnx, tools.soc, soc, found,
            )  # fmt: skip
        else:
            logger.info("model '%s': using the cached compile of '%s' (%s)", config.name, onnx, found)
        return Compiled(found, False, tuple(atc_command.argv(tools.atc or "atc", onnx, folder / "model")))
    return None


def _described(
    config: mc.ModelConfig, onnx: Path, model_dir: Path
) -> tuple[Path, mc.ModelConfig, list[options.AtcOption]]:
    """The ONNX file's absolute path (ATC runs in a staging folder of the cache: a path relative to where geserve
    started means nothing there), the config with the graph's inputs, and its ATC options."""
    onnx, model_dir = onnx.absolute(), model_dir.absolute()
    return onnx, graph_inputs.complete_inputs(config, onnx), options.config_options(config, model_dir)


def _entry(
    model: str,
    onnx: Path,
    described: mc.ModelConfig,
    parsed: list[options.AtcOption],
    tools: Toolchain,
    *,
    soc: str,
) -> tuple[command.AtcCommand, Path]:
    """The ATC command for chip `soc` and the cache folder its `.om` is kept in."""
    atc_command = command.build(described, soc, parsed)
    return atc_command, cache.entry(tools.cache_dir, model, cache.key(onnx, atc_command, soc, tools.cann, tools.opp))


def time_limit(config: mc.ModelConfig, default_s: float) -> float:
    """The config's `atc_timeout_s` parameter (seconds), else `default_s`."""
    if TIMEOUT_PARAMETER not in config.parameters:
        return default_s
    text = config.parameters[TIMEOUT_PARAMETER].string_value
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise ModelLoadError(
            f"model '{config.name}': parameter '{TIMEOUT_PARAMETER}' is '{text}'; it takes the seconds ATC may run, "
            "a positive number"
        )
    return value


@contextlib.contextmanager
def _cache_errors(model: str, cache_dir: Path) -> Iterator[None]:
    """A cache folder this server cannot use is the load's error, named, with what to do about it."""
    try:
        yield
    except OSError as error:
        where = error.filename or cache_dir
        raise ModelLoadError(
            f"model '{model}': the compiled-model cache '{cache_dir}' cannot be used ('{where}': "
            f"{error.strerror or error}); give --model-cache-dir a folder this server can write (the user's "
            "cache folder is the default: $XDG_CACHE_HOME/geserve/om, else ~/.cache/geserve/om)"
        ) from None


def _run(
    model: str,
    argv: tuple[str, ...],
    cwd: Path,
    timeout_s: float,
    cancel: threading.Event | None,
    *,
    env: dict[str, str],
) -> None:
    # ATC writes fusion_result.json and kernel_meta/ into its working directory: the staging folder. Its output
    # goes to a file there, not a pipe, so that waiting on it never blocks on a full pipe.
    output = cwd / "atc_output.txt"
    if _STOPPING.is_set():
        raise ModelLoadError(f"model '{model}': not compiled: the server is stopping")
    try:
        with output.open("wb") as stream:
            process = subprocess.Popen(
                argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=stream, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_die_with_parent,  # noqa: PLW1509 (see _die_with_parent)
            )  # fmt: skip
    except OSError as error:
        raise ModelLoadError(f"model '{model}': cannot run ATC ({argv[0]}): {error}") from None
    deadline = time.monotonic() + timeout_s
    with _RUNNING_LOCK:
        _RUNNING.add(process)
    try:
        while True:
            try:
                returncode = process.wait(_POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass
            if _STOPPING.is_set() or (cancel is not None and cancel.is_set()):
                raise ModelLoadError(
                    f"model '{model}': compile cancelled: the load was given up or the server is stopping"
                )
            if time.monotonic() > deadline:
                raise ModelLoadError(
                    f"model '{model}': ATC did not finish within {timeout_s:g}s (parameter 'atc_timeout_s' sets the "
                    f"limit): {shlex.join(argv)}"
                )
    finally:
        with _RUNNING_LOCK:
            _RUNNING.discard(process)
        if process.returncode is None:  # cancelled, timed out, or this thread interrupted (Ctrl-C offline)
            stop_process_group(process, "ATC")
    if returncode != 0 and (_STOPPING.is_set() or (cancel is not None and cancel.is_set())):
        raise ModelLoadError(_cancelled(model))  # killed by stop_compiles while waiting
    if returncode != 0:
        # ATC reports errors (E10001, ...) on stdout as often as on stderr: show the end of both.
        lines = output.read_text(errors="replace").strip().splitlines()[-_TAIL_LINES:]
        tail = "\n".join(lines) or "no output"
        # The most common cause on a fresh host: the python3 ATC found cannot run CANN's operator compiler.
        python = check_atc_python(env)
        hint = "".join(f"\n{problem}" for problem in python.problems)
        raise ModelLoadError(f"model '{model}': ATC failed (exit {returncode}): {shlex.join(argv)}\n{tail}{hint}")


def _cancelled(model: str) -> str:
    return f"model '{model}': compile cancelled: the load was given up or the server is stopping"


def stop_compiles() -> None:
    """The server is stopping: every running ATC is killed (its load fails) and no other one starts."""
    _STOPPING.set()
    with _RUNNING_LOCK:
        running = list(_RUNNING)
    for process in running:
        _kill_group(process)


def stop_process_group(process: subprocess.Popen[bytes], what: str) -> None:
    """Kill the process group `process` leads (ATC starts compiler processes of its own) and reap it; a process
    that does not die (stuck in the driver, in D state) is abandoned with a warning rather than waited for."""
    _kill_group(process)
    try:
        process.wait(_REAP_S)
    except subprocess.TimeoutExpired:
        logger.warning("%s (pid %d) did not exit %gs after SIGKILL; leaving it behind", what, process.pid, _REAP_S)


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    # The child leads its own session (start_new_session), so its group id is its pid.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def _die_with_parent() -> None:
    """In the child before exec: a server killed outright (SIGKILL) takes its ATC with it (Linux prctl
    PR_SET_PDEATHSIG; the signal comes when the forking thread ends, which outlives the compile). Its own session
    keeps it out of terminal signals, so nothing else would. Safe after fork: one libc call resolved beforehand,
    no lock taken."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)
