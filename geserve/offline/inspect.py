"""`geserve inspect FILE.om`: what an `.om` declares, and a config.pbtxt that would serve it."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from google.protobuf import text_format

from geserve._generated import model_config_pb2 as mc
from geserve.backends.acl import completion
from geserve.backends.acl.description import OmDescription, check_output_dims, check_servable, type_name
from geserve.backends.acl.om_file import read_description
from geserve.errors import GeserveError


def main(argv: Sequence[str], prog: str = "geserve") -> int:
    parser = argparse.ArgumentParser(prog=f"{prog} inspect", description=__doc__)
    parser.add_argument("file", type=Path, help="an ATC-compiled .om file")
    parser.add_argument("--json", action="store_true", help="the description as JSON (the keys of expected.json)")
    parser.add_argument("--name", default="", help="the model name for the config (default: the file's stem)")
    args = parser.parse_args(argv)
    try:
        om = read_description(args.file)
    except GeserveError as error:
        sys.stderr.write(f"{parser.prog}: {error.message}\n")
        return 1
    if args.json:
        sys.stdout.write(json.dumps(om.to_json(), indent=1) + "\n")
        return 0
    sys.stdout.write(describe_text(om, args.file))
    name = args.name or args.file.stem
    try:
        config = serving_config(om, name, str(args.file))
    except GeserveError as error:
        sys.stdout.write(f"\nnot servable by geserve: {error.message}\n")
        return 1
    sys.stdout.write(f"\nconfig.pbtxt that serves it (model_path relative to the model folder: adjust):\n\n{config}")
    return 0


def serving_config(om: OmDescription, name: str, model_file: str) -> str:
    """The config auto-complete would produce for this file, as config.pbtxt text."""
    check_servable(om, name, model_file)
    check_output_dims(om, name, model_file)
    config = mc.ModelConfig(name=name, backend="ge")
    config.parameters["model_path"].string_value = Path(model_file).name
    completion.complete(config, om, True, model_file)
    return text_format.MessageToString(config)


def describe_text(om: OmDescription, path: Path) -> str:
    lines = [
        f"file: {path}",
        f"model: {om.name or '-'}   header: {om.to_json()['header_version'] or 'OM2 archive'}   "
        f"soc: {om.soc_version or 'not recorded'}",
        "inputs:",
    ]
    tensors = sorted((*om.inputs, *([om.dynamic_input] if om.dynamic_input else [])), key=lambda t: t.index)
    for tensor in tensors:
        note = "  (filled by the runtime with the gear)" if tensor is om.dynamic_input else ""
        if tensor.dims_v1:
            note = f"  (static AIPP: the image is {list(tensor.dims_v1)}, aclmdlGetInputDims)"
        lines.append(
            f"  {tensor.index}: {tensor.name}  {type_name(tensor.acl_type)}  {list(tensor.dims)}  {tensor.format}{note}"
        )
    lines.append("outputs:")
    for tensor in om.outputs:
        lines.append(
            f"  {tensor.index}: {tensor.name}  {type_name(tensor.acl_type)}  {list(tensor.dims)}  {tensor.format}"
        )
    if om.gear_kind:
        values = list(om.gears) if om.gears else [list(s) for s in om.gear_shapes]
        lines.append(f"gears: {om.gear_kind.replace('_', ' ')} {values} (inputs {list(om.data_name_order)})")
    else:
        lines.append("gears: none (static shapes)")
    return "\n".join(lines) + "\n"
