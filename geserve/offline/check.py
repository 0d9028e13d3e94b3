"""`geserve check --model-repository DIR`: every model of a repository checked offline, one line per problem."""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from geserve._generated import model_config_pb2 as mc
from geserve.atc import command, graph_inputs, options
from geserve.backends import registry
from geserve.backends.acl import completion
from geserve.backends.acl.description import check_output_dims, check_servable
from geserve.backends.acl.om_file import read_description
from geserve.core.ensemble import is_ensemble
from geserve.core.loader import prepare_model
from geserve.errors import GeserveError
from geserve.offline import completable, composition
from geserve.offline.problems import Checked, Problem, unchecked
from geserve.repository import config as config_io
from geserve.repository.scan import ModelSource, scan_repositories
from geserve.settings import WorkerSettings
from geserve.workers.npu_mode import ONNX_FILE
from geserve.workers.placement import model_file_path
from geserve.workers.pool import InstancePools

# Which config field a backend's message is about, by the words it uses.
_FIELDS = (
    (re.compile(r"failed to parse"), "config"),
    (re.compile(r"config input '"), "input"),
    (re.compile(r"config output '"), "output"),
    (re.compile(r"inputs \[.*\] of .* are missing"), "input"),
    (re.compile(r"\binput '"), "input"),
    (re.compile(r"\boutput '"), "output"),
    (re.compile(r"max_batch_size"), "max_batch_size"),
    (re.compile(r"preferred_batch_size"), "dynamic_batching"),
    (re.compile(r"parameter 'model_path'"), "parameters.model_path"),
    (re.compile(r"version"), "version_policy"),
    (re.compile(r"backend|platform"), "backend"),
)


def main(argv: Sequence[str], prog: str = "geserve") -> int:
    parser = argparse.ArgumentParser(prog=f"{prog} check", description=__doc__)
    parser.add_argument("--model-repository", type=Path, action="append", required=True, metavar="DIR")
    args = parser.parse_args(argv)
    problems: list[Problem] = []
    try:
        scan = scan_repositories(args.model_repository)
    except FileNotFoundError as error:
        sys.stdout.write(f"{error}\n")
        return 1
    for name, reason in sorted(scan.conflicts.items()):
        problems.append(Problem(Path(name), "name", reason))
    checked = {name: check_model(source) for name, source in scan.models.items()}
    composition.check_ensembles(scan.models, checked)
    notes: list[Problem] = []
    warnings: list[Problem] = []
    for result in checked.values():
        problems += result.problems
        notes += result.notes
        warnings += result.warnings
    for problem in [*problems, *warnings, *notes]:
        sys.stdout.write(f"{problem}\n")
    noted = (f", {len(warnings)} warning(s)" if warnings else "") + (f", {len(notes)} not checked" if notes else "")
    if problems:
        sys.stdout.write(f"{len(problems)} problem(s) in {len(scan.models)} model(s){noted}\n")
        return 1
    sys.stdout.write(f"{len(scan.models)} model(s) checked: no problems{noted}\n")
    return 0


def check_model(source: ModelSource) -> Checked:
    """What would keep the model from loading, found without loading it on a device; an ensemble's steps are
    checked once every model is (`composition`)."""
    config_path = source.path / "config.pbtxt"
    try:
        # Placed as on a machine without accelerators: every KIND_AUTO group on the CPU.
        config, versions = prepare_model(source, InstancePools(WorkerSettings()))
        if is_ensemble(config):
            return Checked(configs=dict.fromkeys(versions, config))
        backend = registry.by_name(config.backend)
    except GeserveError as error:
        return Checked([Problem(config_path, _field(error.message, "config"), error.message)])
    checked = Checked()
    for version in versions:
        try:
            path = model_file_path(source, config, backend, version)
        except GeserveError as error:
            checked.problems.append(Problem(config_path, "parameters.model_path", error.message))
            break
        onnx = source.path / str(version) / ONNX_FILE
        served = config
        if backend.name == "ge" and not path.is_file() and onnx.is_file():
            problems, warnings, notes = _compilable(config, source, onnx, config_path)  # compiled with ATC at load
            checked.warnings += warnings
            checked.notes += notes
            checked.completed_at_load = "completed at load from the .om that ATC compiles"
        elif backend.default_filename and not path.is_file():
            problems = [Problem(path, "default_model_filename", f"version {version}'s model file does not exist")]
        elif backend.name == "python" and _defines_auto_complete(path):
            # Model code completes the config at load, and check never runs model code.
            checked.completed_at_load = "its auto_complete_config runs at load, in the server only"
            problems, notes = _self_completing(config, config_path, checked.completed_at_load)
            checked.notes += notes
        else:
            problems, served = _agreement(config, backend, path, config_path)
        if not problems:
            checked.configs[version] = served
        checked.problems += problems
    return checked


def _compilable(
    config: mc.ModelConfig, source: ModelSource, onnx: Path, config_path: Path
) -> tuple[list[Problem], list[Problem], list[Problem]]:
    """A `ge` version with only model.onnx: the config must give everything its ATC command needs, in shapes the
    graph takes. (problems, warnings, notes)"""
    try:
        described = graph_inputs.describe(config, onnx)
        command.build(described.config, "check", options.config_options(config, source.path))
    except GeserveError as error:
        message = f"compiling '{onnx}' with ATC: {error.message}"
        return [Problem(config_path, _field(error.message, "parameters"), message)], [], []
    warnings = [Problem(config_path, "input", f"warning: {warning}") for warning in described.warnings]
    notes = [Problem(onnx, "input", f"not checked: {described.unchecked}")] if described.unchecked else []
    return [], warnings, notes


def _agreement(
    config: mc.ModelConfig, backend: registry.BackendSpec, path: Path, config_path: Path
) -> tuple[list[Problem], mc.ModelConfig]:
    """The config completed from, and checked against, the model file, as the backend would at load."""
    completed = mc.ModelConfig()
    completed.CopyFrom(config)
    try:
        if backend.name == "ge":
            om = read_description(path)
            check_servable(om, config.name, str(path))
            try:
                check_output_dims(om, config.name, str(path))
            except GeserveError as error:  # the file's own fault, whatever the config says
                return [Problem(path, "model file", error.message)], completed
            completion.complete(completed, om, True, str(path))
        elif backend.name == "onnxruntime":
            instance = backend.create()
            try:
                instance.load(completed, path, 0)
                instance.complete_config(completed, True)
            finally:
                instance.unload()
        config_io.validate_config(completed)
    except GeserveError as error:
        where = path if error.message.startswith(f"'{path}'") else config_path  # the file itself is unreadable
        return [Problem(where, _field(error.message, "model file"), error.message)], completed
    except ImportError as error:  # onnxruntime is an optional extra
        return [Problem(path, "backend", f"cannot be checked here: {error}")], completed
    return [], completed


def _self_completing(config: mc.ModelConfig, config_path: Path, reason: str) -> tuple[list[Problem], list[Problem]]:
    """A python model whose auto_complete_config may fill what its config leaves out: (problems, notes). What fails
    validation even as that function could at best complete the config is a problem; what only the config as written
    fails, a note."""
    try:
        config_io.validate_config(config)
    except GeserveError as error:
        as_written = error.message
    else:
        return [], []
    try:
        config_io.validate_config(completable.as_auto_complete_could_fill(config))
    except GeserveError as error:
        return [Problem(config_path, _field(error.message, "config"), error.message)], []
    note = unchecked(as_written, {config.name: reason})
    return [], [Problem(config_path, _field(as_written, "model file"), note)]


def _defines_auto_complete(path: Path) -> bool:
    """Whether model.py defines `auto_complete_config`, read without running it."""
    try:
        tree = ast.parse(path.read_bytes(), str(path))
    except (OSError, SyntaxError, ValueError):
        return False  # the server's load reports an unreadable model.py
    return any(
        isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == "auto_complete_config"
        for node in ast.walk(tree)
    )


def _field(message: str, default: str) -> str:
    for pattern, field in _FIELDS:
        if pattern.search(message):
            return field
    return default
