"""`geserve compile --model-repository DIR`: compile every `ge` model's model.onnx with ATC into the cache, offline."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from geserve.atc import cache, compiler, host
from geserve.atc.python_env import atc_environment, check_atc_python
from geserve.backends import registry
from geserve.core.loader import prepare_model
from geserve.errors import GeserveError, ModelLoadError
from geserve.repository.scan import ModelSource, scan_repositories
from geserve.settings import WorkerSettings
from geserve.workers.npu_mode import ONNX_FILE, has_om
from geserve.workers.pool import InstancePools


def main(argv: Sequence[str], prog: str = "geserve") -> int:
    parser = argparse.ArgumentParser(prog=f"{prog} compile", description=__doc__)
    parser.add_argument("--model-repository", type=Path, action="append", required=True, metavar="DIR")
    parser.add_argument(
        "--model-cache-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="the cache the server reads with the same flag (default: $XDG_CACHE_HOME/geserve/om, else "
        "~/.cache/geserve/om)",
    )
    parser.add_argument(
        "--soc-version",
        default="",
        metavar="SOC",
        help="the chip to compile for, as ATC's --soc_version (default: this host's, asked of pyACL); a build "
        "machine without an NPU must give it, and it must be the serving host's chip for the cache to match",
    )
    parser.add_argument(
        "--atc-python",
        default=None,
        metavar="PATH",
        help="the Python interpreter ATC's operator compiler runs in (default: the python3 on PATH, geserve's own "
        "virtual environment left out), as the server's --atc-python",
    )
    args = parser.parse_args(argv)
    try:
        scan = scan_repositories(args.model_repository)
    except FileNotFoundError as error:
        sys.stdout.write(f"{error}\n")
        return 1
    compiling = _Compiling(args.model_cache_dir or cache.default_dir(), args.soc_version, args.atc_python)
    failed = 0
    for name, reason in sorted(scan.conflicts.items()):
        sys.stdout.write(f"{name}: failed: {reason}\n")
        failed += 1
    for name in sorted(scan.models):
        for line, ok in compiling.model(scan.models[name]):
            sys.stdout.write(f"{line}\n")
            failed += not ok
    return 1 if failed else 0


class _Compiling:
    """One run's toolchain, found once: a missing atc or chip name fails every model that needs them."""

    def __init__(self, cache_dir: Path, soc: str, python: str | None = None) -> None:
        self._cache_dir = cache_dir
        self._soc = soc
        self._python = python
        self._tools: compiler.Toolchain | None = None

    def model(self, source: ModelSource) -> list[tuple[str, bool]]:
        """(line, succeeded) per version; one line for the model when it is skipped or unreadable."""
        try:
            config, versions = prepare_model(source, InstancePools(WorkerSettings()))
            backend = registry.by_name(config.backend)
        except GeserveError as error:
            return [(f"{source.name}: failed: {error.message}", False)]
        if backend.name != "ge":
            return [(f"{source.name}: skipped: backend '{backend.name}' is not compiled", True)]
        lines = []
        for version in versions:
            where = f"{source.name} version {version}"
            onnx = source.path / str(version) / ONNX_FILE
            if has_om(source, config, backend, version):
                lines.append((f"{where}: skipped: it has an .om already", True))
            elif not onnx.is_file():
                lines.append((f"{where}: skipped: no {ONNX_FILE} to compile", True))
            else:
                try:
                    done = compiler.compile_version(config, onnx, source.path, self._toolchain())
                except GeserveError as error:
                    lines.append((f"{where}: failed: {error.message}", False))
                    continue
                lines.append((f"{where}: {'compiled' if done.compiled else 'cached'}: {done.om}", True))
        return lines

    def _toolchain(self) -> compiler.Toolchain:
        if self._tools is None:
            atc = host.find_atc()
            if atc is None:
                raise ModelLoadError("CANN's atc is not on PATH (source CANN's set_env.sh)")
            try:
                soc = self._soc or host.soc_name()
            except ModelLoadError as error:
                raise ModelLoadError(f"{error.message}; on a machine without an NPU give --soc-version") from None
            # What would make every compile fail, said once before the first one.
            for problem in check_atc_python(atc_environment(self._python)).problems:
                sys.stdout.write(f"warning: {problem}\n")
            cann, opp = host.cann_version(atc=atc), host.opp_version(atc=atc)
            self._tools = compiler.Toolchain(atc, soc, cann, self._cache_dir, python=self._python, opp=opp)
        return self._tools
