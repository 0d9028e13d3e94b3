"""The ATC flags a config may add (`parameters { key: "atc_option.<flag>" }`) and the ones geserve sets itself."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from geserve._generated import model_config_pb2 as mc
from geserve.errors import ModelLoadError

PREFIX = "atc_option."

# Set by geserve from the config and the host; a config that sets them is refused (ATC docs, "参数概览"
# table 1: --model/--framework/--output/--soc_version are required for --mode=0; --input_shape and
# --dynamic_batch_size follow from the config's inputs and batching).
SET_BY_GESERVE = frozenset(
    {"mode", "model", "weight", "framework", "output", "soc_version", "input_shape", "dynamic_batch_size"}
)
# Gear kinds ATC cannot combine with --dynamic_batch_size (HIASCEND atlasatcparam_16_0018: mutually
# exclusive with --dynamic_image_size, --dynamic_dims, --input_shape_range); geserve serves only batch gears.
CONFLICTING = frozenset({"dynamic_image_size", "dynamic_dims", "input_shape_range"})
# Documented ATC options (CANN ATC user guide, "参数概览" / Command-Line Options) a serving model may want.
ALLOWED = frozenset(
    {
        "input_format",
        "output_type",
        "precision_mode",
        "precision_mode_v2",
        "op_precision_mode",
        "op_select_implmode",
        "optypelist_for_implmode",
        "keep_dtype",
        "modify_mixlist",
        "customize_dtypes",
        "insert_op_conf",
        "enable_small_channel",
        "fusion_switch_file",
        "buffer_optimize",
        "compression_optimize_conf",
        "sparsity",
        "external_weight",
        "out_nodes",
        "input_fp16_nodes",
        "is_input_adjust_hw_layout",
        "is_output_adjust_hw_layout",
        "op_debug_level",
        "op_compiler_cache_mode",
        "op_compiler_cache_dir",
        "virtual_type",
        "status_check",
        "log",
    }
)
# Options whose value is a file: resolved inside the model folder, and its bytes are part of the cache key.
FILE_VALUED = frozenset(
    {
        "insert_op_conf",
        "fusion_switch_file",
        "keep_dtype",
        "modify_mixlist",
        "customize_dtypes",
        "compression_optimize_conf",
        "op_precision_mode",  # an .ini file of op:mode lines (ATC docs, --op_precision_mode)
    }
)


@dataclass(frozen=True, slots=True)
class AtcOption:
    flag: str
    value: str
    file: Path | None = None  # for FILE_VALUED flags: the file the value names
    # What the cache key holds for it: for a file, its path inside the model folder, not where that folder is
    # (a repository copied to a fresh folder at every start must find its compiles again).
    key_value: str = ""

    def key_argument(self) -> str:
        return f"--{self.flag}={self.key_value or self.value}"


def config_options(config: mc.ModelConfig, model_dir: Path) -> list[AtcOption]:
    """The `atc_option.<flag>` parameters, checked: unknown flags and flags geserve sets are refused by name."""
    return parse(
        {key: value.string_value for key, value in config.parameters.items() if key.startswith(PREFIX)},
        config.name,
        model_dir,
    )


def parse(parameters: Mapping[str, str], model: str, model_dir: Path) -> list[AtcOption]:
    options = []
    owned, conflicting, unknown = [], [], []
    for key in sorted(parameters):
        flag = key.removeprefix(PREFIX).removeprefix("--").replace("-", "_")  # ATC takes soc-version as soc_version
        if flag in SET_BY_GESERVE:
            owned.append(key)
        elif flag in CONFLICTING:
            conflicting.append(key)
        elif flag not in ALLOWED:
            unknown.append(key)
        else:
            options.append(_option(flag, parameters[key], key, model, model_dir))
    problems = []
    if owned:
        problems.append(f"{', '.join(owned)} set ATC flags geserve derives from the config and the host")
    if conflicting:
        problems.append(f"{', '.join(conflicting)} ask for gears other than batch gears, which geserve does not serve")
    if unknown:
        problems.append(
            f"{', '.join(unknown)} name no ATC flag geserve passes on (known: {', '.join(sorted(ALLOWED))})"
        )
    if problems:
        raise ModelLoadError(f"model '{model}': parameters {'; '.join(problems)}")
    return options


def _option(flag: str, value: str, key: str, model: str, model_dir: Path) -> AtcOption:
    if not value or value != value.strip():
        raise ModelLoadError(f"model '{model}': parameter '{key}' needs a value without surrounding spaces")
    if flag == "op_compiler_cache_dir":
        # ATC runs in a staging folder: a relative folder is taken inside the model folder, where the config is.
        return AtcOption(flag, str((model_dir / value).absolute()), key_value=value)
    if flag not in FILE_VALUED:
        return AtcOption(flag, value)
    path = (model_dir / value).resolve()
    if not path.is_relative_to(model_dir.resolve()) or not path.is_file():
        raise ModelLoadError(f"model '{model}': parameter '{key}' ('{value}') names no file inside the model folder")
    return AtcOption(flag, str(path), path, path.relative_to(model_dir.resolve()).as_posix())
