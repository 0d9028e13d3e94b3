"""ATC output names (`<node>:<index>:<onnx name>`, `<node>:<index>`) matched to the names a config uses."""

# ATC renames outputs (GE's model_introduction.cc; aclmdlGetOutputNameByIndex's doc): an ONNX output
# `prob` comes out as `prob_node:0:prob`, a TensorFlow one as `dense/Softmax:0`. A config may name an
# output by its full ATC name, by the ONNX name that follows `<node>:<index>:` in a three-part name, or
# by the node name without `:<index>` of a two-part name. The ONNX name may itself hold `:` (every
# tf2onnx export names its outputs `Identity:0`, which ATC makes `Identity_node:0:Identity:0`), so a
# three-part name splits at its first `:<digits>:`; the node part is ATC's own op name.

from __future__ import annotations

import re
from collections.abc import Sequence

from geserve.errors import ModelLoadError

_THREE_PART = re.compile(r"^(?P<node>.+?):(?P<index>\d+):(?P<source>.+)$")
_TWO_PART = re.compile(r"^(?P<node>.+):(?P<index>\d+)$")
# Where auto-complete records an output's full ATC name when the config shows a shorter one.
FULL_NAME_PARAMETER = "om_output_name.{}"


def short_name(full: str) -> str | None:
    """The name a config may use instead of `full`, or None when ATC kept the name as it was."""
    match = _THREE_PART.match(full)
    if match is not None:
        return match["source"]
    match = _TWO_PART.match(full)
    return match["node"] if match is not None else None


def resolve(wanted: str, full_names: Sequence[str], model: str, model_file: str) -> str:
    """The full ATC name the config's output `wanted` stands for; a load error if none or several."""
    if wanted in full_names:
        return wanted
    candidates = [full for full in full_names if short_name(full) == wanted]
    if len(candidates) == 1:
        return candidates[0]
    if candidates:
        raise ModelLoadError(
            f"model '{model}': config output '{wanted}' matches several outputs of '{model_file}': {candidates}; "
            "name it by its full ATC name"
        )
    raise ModelLoadError(
        f"model '{model}': config output '{wanted}' is not in '{model_file}', whose outputs are {list(full_names)} "
        "(a config may use the full ATC name, the ONNX name after '<node>:<index>:', or the node name without "
        "':<index>')"
    )


def shortest_unique(full_names: Sequence[str]) -> list[str]:
    """Each output's shortest name that names it alone (its full name where the short one is shared)."""
    shorts = [short_name(full) for full in full_names]
    taken = set(full_names)
    names = []
    for full, short in zip(full_names, shorts, strict=True):
        unique = short is not None and shorts.count(short) == 1 and (short not in taken or short == full)
        names.append(short if unique and short is not None else full)
    return names
