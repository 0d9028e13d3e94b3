"""The ATC command line that compiles a model's ONNX file as its config describes it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from geserve._generated import model_config_pb2 as mc
from geserve.atc.options import AtcOption
from geserve.errors import ModelLoadError

# ATC takes 2-100 gears for --dynamic_batch_size (HIASCEND atlasatcparam_16_0018; 256 only on Atlas 350).
MAX_GEARS = 100
# --input_format for an ONNX model (--framework=5) is NCHW (the default), NCDHW or ND, "ND" meaning any layout
# (HIASCEND atlasatcparam_16_0015); NHWC is refused. ONNX graphs carry no layout: ATC compiles the shapes
# --input_shape gives, and the format only labels the input (it matters for AIPP). So an NHWC input, which
# the graph takes as [N,H,W,C], is labelled ND: its data is not reordered and "NCHW" would be a false label.
_FORMATS = {mc.ModelInput.FORMAT_NCHW: "NCHW", mc.ModelInput.FORMAT_NHWC: "ND"}
ONNX_INPUT_FORMATS = ("NCHW", "NCDHW", "ND")
# With --insert_op_conf (AIPP) the same page allows only NCHW or NHWC: for ONNX, NCHW.
AIPP_INPUT_FORMATS = ("NCHW",)


@dataclass(frozen=True, slots=True)
class AtcCommand:
    """What ATC is asked: `arguments` hold every flag but --model and --output, which name paths."""

    arguments: tuple[str, ...]
    files: tuple[Path, ...]  # files options name: their bytes belong in the cache key
    # `arguments` as the cache key holds them: files named by their path inside the model folder.
    key_arguments: tuple[str, ...] = ()

    def argv(self, atc: str, model: Path, output: Path) -> list[str]:
        # ATC appends `.om` to --output (pyacl.md §8)
        return [atc, "--framework=5", f"--model={model}", f"--output={output}", *self.arguments]


def gears(config: mc.ModelConfig) -> list[int]:
    """Batch gears: 1, max_batch_size and every preferred batch size, sorted and unique; none without batching."""
    if config.max_batch_size <= 0:
        return []
    preferred = list(config.dynamic_batching.preferred_batch_size) if config.HasField("dynamic_batching") else []
    too_large = [size for size in preferred if size > config.max_batch_size or size < 1]
    if too_large:
        raise ModelLoadError(
            f"model '{config.name}': preferred_batch_size {too_large} lies outside 1..max_batch_size "
            f"({config.max_batch_size})"
        )
    values = sorted({1, config.max_batch_size, *preferred})
    if len(values) > MAX_GEARS:
        raise ModelLoadError(
            f"model '{config.name}': {len(values)} batch gears (1, max_batch_size and preferred_batch_size); ATC "
            f"compiles at most {MAX_GEARS}"
        )
    return values


def build(config: mc.ModelConfig, soc_version: str, options: list[AtcOption]) -> AtcCommand:
    """--input_shape from the config's inputs (`-1` batch with gears, a fixed batch of 1 when the only gear
    is 1), --dynamic_batch_size from the gears, --soc_version from the host, then the config's options."""
    if not config.input:
        raise ModelLoadError(
            f"model '{config.name}': compiling model.onnx with ATC needs its inputs (names and dims), which give "
            "--input_shape; list them in config.pbtxt"
        )
    batch_gears = gears(config)
    shapes = []
    for tensor in config.input:
        # The model's own shape is reshape.shape when the config sets it (clients send `dims`).
        model_dims = list(tensor.reshape.shape) if tensor.HasField("reshape") else list(tensor.dims)
        variable = [d for d in model_dims if d < 0]
        if variable:
            raise ModelLoadError(
                f"model '{config.name}': input '{tensor.name}' has variable dims {model_dims}; ATC needs "
                "fixed dims to compile with batch gears: give every dim in config.pbtxt"
            )
        dims = [str(d) for d in model_dims]
        if config.max_batch_size > 0:
            dims.insert(0, "-1" if len(batch_gears) > 1 else "1")
        shapes.append(f"{tensor.name}:{','.join(dims)}")
    arguments = [f"--input_shape={';'.join(shapes)}"]
    if len(batch_gears) > 1:
        arguments.append(f"--dynamic_batch_size={','.join(str(g) for g in batch_gears)}")
    arguments.append(f"--soc_version={soc_version}")
    formats = {_FORMATS[t.format] for t in config.input if t.format in _FORMATS}
    if len(formats) > 1:
        raise ModelLoadError(
            f"model '{config.name}': inputs give formats {sorted(formats)}; ATC takes one --input_format"
        )
    if formats and any(option.flag == "input_format" for option in options):
        raise ModelLoadError(
            f"model '{config.name}': parameter 'atc_option.input_format' and the inputs' format both set --input_format"
        )
    arguments += [f"--input_format={fmt}" for fmt in formats]
    given = [option.value for option in options if option.flag == "input_format"]
    if given and given[0] not in ONNX_INPUT_FORMATS:
        raise ModelLoadError(
            f"model '{config.name}': parameter 'atc_option.input_format' is '{given[0]}'; ATC takes "
            f"{', '.join(ONNX_INPUT_FORMATS)} for ONNX models (an NHWC input is given as ND)"
        )
    chosen = [*formats, *given]
    if any(option.flag == "insert_op_conf" for option in options) and chosen and chosen[0] not in AIPP_INPUT_FORMATS:
        raise ModelLoadError(
            f"model '{config.name}': with 'atc_option.insert_op_conf' (AIPP) ATC takes --input_format=NCHW for ONNX "
            f"models, but the inputs give {chosen[0]} (FORMAT_NHWC inputs are compiled as ND)"
        )
    common = tuple(arguments)
    arguments += [f"--{option.flag}={option.value}" for option in options]
    files = tuple(option.file for option in options if option.file is not None)
    return AtcCommand(tuple(arguments), files, (*common, *(option.key_argument() for option in options)))
