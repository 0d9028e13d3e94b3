"""Compiles one model version's ONNX file with ATC into the cache, or finds it there."""

from __future__ import annotations

import logging
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from geserve._generated import model_config_pb2 as mc
from geserve.atc import cache, command, graph_inputs, options
from geserve.errors import ModelLoadError

logger = logging.getLogger(__name__)

# A large model takes ATC many minutes; a hung one must still fail the load.
COMPILE_TIMEOUT_S = 3600.0
_TAIL_LINES = 15


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


def compile_version(config: mc.ModelConfig, onnx: Path, model_dir: Path, tools: Toolchain) -> Compiled:
    """The cached `.om` for this ONNX file, config and host, compiling it first when it is not there."""
    described = graph_inputs.complete_inputs(config, onnx)
    atc_command = command.build(described, tools.soc, options.config_options(config, model_dir))
    digest = cache.key(onnx, atc_command, tools.soc, tools.cann)
    folder = cache.entry(tools.cache_dir, config.name, digest)
    found = cache.lookup(folder)
    if found is not None:
        argv = tuple(atc_command.argv(tools.atc, onnx, folder / "model"))
        logger.info("model '%s': using the cached compile of '%s' (%s)", config.name, onnx, found)
        return Compiled(found, False, argv)
    staged = cache.staging(tools.cache_dir, 2 * tools.timeout_s)
    try:
        argv = tuple(atc_command.argv(tools.atc, onnx, staged / "model"))
        logger.info("model '%s': compiling '%s' with ATC: %s", config.name, onnx, shlex.join(argv))
        _run(config.name, argv, staged, tools.timeout_s)
        if cache.lookup(staged) is None:
            raise ModelLoadError(f"model '{config.name}': ATC exited 0 but wrote no '{staged / cache.MODEL_FILE}'")
        (staged / "atc_command.txt").write_text(shlex.join(argv) + "\n")
        om = cache.publish(staged, folder)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    logger.info("model '%s': compiled '%s' into '%s'", config.name, onnx, om)
    return Compiled(om, True, argv)


def _run(model: str, argv: tuple[str, ...], cwd: Path, timeout_s: float) -> None:
    # ATC writes fusion_result.json and kernel_meta/ into its working directory: the staging folder.
    try:
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise ModelLoadError(f"model '{model}': ATC did not finish within {timeout_s:g}s: {shlex.join(argv)}") from None
    except OSError as error:
        raise ModelLoadError(f"model '{model}': cannot run ATC ({argv[0]}): {error}") from None
    if done.returncode != 0:
        # ATC reports errors (E10001, ...) on stdout as often as on stderr: show the end of both.
        lines = [*done.stdout.strip().splitlines(), *done.stderr.strip().splitlines()][-_TAIL_LINES:]
        tail = "\n".join(lines) or "no output"
        raise ModelLoadError(f"model '{model}': ATC failed (exit {done.returncode}): {shlex.join(argv)}\n{tail}")
