"""What the simulator makes of an `.om` file: the description geserve's offline reader gives, and how to run it.

Names, dims, dtypes, formats and gears come from the real file (read as om-format.md lays it out),
so they are ATC's, not the simulator's. A model runs with its ONNX twin when the test supplies one
(`<file>.twin.onnx` beside the `.om`: the model it was compiled from), else with deterministic
outputs of the described shape: every element of row r of every output is the sum of row r of the
first input (the whole tensor's sum without a batch), so each response can still be checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from geserve.backends.acl import names
from geserve.backends.acl.description import FORMAT_VALUES, OmDescription
from geserve.backends.acl.om_file import read_description
from geserve.errors import ModelLoadError

TWIN_SUFFIX = ".twin.onnx"


def twin_path(om_path: Path) -> Path:
    return om_path.with_name(om_path.name.removesuffix(".om") + TWIN_SUFFIX)


@dataclass
class OmModel:
    """One loaded file, in the simulator's terms: tensors as dicts at their runtime indexes."""

    description: OmDescription
    inputs: list[dict[str, Any]]  # the gear input included, at its index
    outputs: list[dict[str, Any]]
    gears: list[int]
    session: Any  # onnxruntime session of the twin, or None
    twin_outputs: list[str]  # the twin's output name for each .om output
    file_bytes: int


def load(path: Path) -> OmModel:
    """ValueError when the file is not a readable `.om`."""
    try:
        om = read_description(path)
    except ModelLoadError as error:
        raise ValueError(error.message) from None
    tensors = sorted((*om.inputs, *([om.dynamic_input] if om.dynamic_input else [])), key=lambda t: t.index)
    inputs = [_tensor(t.name, t.acl_type, t.format, t.dims) for t in tensors]
    for tensor, described in zip(inputs, tensors, strict=True):
        if described.dims_v1:  # static AIPP: "dims" are the buffer's, which the two dims calls report apart
            tensor["dims_v1"], tensor["dims_v2"] = list(described.dims_v1), list(described.dims_v2)
    outputs = [_tensor(t.name, t.acl_type, t.format, t.dims) for t in om.outputs]
    session, twin_outputs = None, []
    twin = twin_path(path)
    if twin.is_file():
        session = _session(twin)
        twin_outputs = _match_twin_outputs([t["name"] for t in outputs], [o.name for o in session.get_outputs()])
    return OmModel(om, inputs, outputs, list(om.gears), session, twin_outputs, path.stat().st_size)


def _tensor(name: str, acl_type: int, fmt: str, dims: tuple[int, ...]) -> dict[str, Any]:
    return {"name": name, "dtype": acl_type, "format": FORMAT_VALUES.get(fmt, -1), "dims": list(dims)}


def _session(path: Path) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


def _match_twin_outputs(om_names: list[str], twin_names: list[str]) -> list[str]:
    """The twin output behind each ATC-named output: same name, the ONNX name ATC kept, or position."""
    matched = []
    for index, full in enumerate(om_names):
        short = names.short_name(full)
        if full in twin_names:
            matched.append(full)
        elif short in twin_names:
            matched.append(str(short))
        else:
            matched.append(twin_names[index])
    return matched


def run(model: OmModel, feeds: dict[str, np.ndarray], numpy_types: dict[int, Any]) -> list[np.ndarray]:
    """Each output's values, in output order, at the shapes the feeds imply."""
    if model.session is not None:
        results = model.session.run(model.twin_outputs, feeds)
        return [np.asarray(r) for r in results]
    first = next(iter(feeds.values()))
    batch = first.shape[0] if model.gears or _batched(model, first) else None
    outputs = []
    for tensor in model.outputs:
        dtype = numpy_types[tensor["dtype"]]
        dims = list(tensor["dims"])
        if batch is not None:
            # numpy's own accumulator (float32 for float32 rows): a float64 one costs 5x on image-sized rows
            sums = first.reshape(batch, -1).sum(axis=1)
            dims[0] = batch
            value = np.broadcast_to(sums.reshape([batch] + [1] * (len(dims) - 1)), dims)
        else:
            value = np.full(dims, first.sum())
        outputs.append(np.ascontiguousarray(value).astype(dtype))
    return outputs


def _batched(model: OmModel, first: np.ndarray) -> bool:
    """A static model whose outputs share the first input's leading dim is run row by row."""
    return first.ndim > 0 and all(t["dims"] and t["dims"][0] == first.shape[0] for t in model.outputs)
