"""The classification extension: an output replaced by its top-k "value:index[:label]" strings."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from geserve._generated import model_config_pb2 as mc
from geserve.errors import InvalidArgumentError


def read_labels(model_dir: Path, config: mc.ModelConfig) -> dict[str, list[str]]:
    """Each output's labels, one per line of its `label_filename` in the model folder."""
    labels: dict[str, list[str]] = {}
    for output in config.output:
        if not output.label_filename:
            continue
        path = (model_dir / output.label_filename).resolve()
        if not path.is_relative_to(model_dir.resolve()):
            continue  # a label file outside the model folder is not read
        try:
            labels[output.name] = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            labels[output.name] = []
    return labels


def classification_count(value: object, output: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"'classification' of output '{output}' must be a positive integer, got {value!r}")
    return value


def classify(array: np.ndarray, k: int, labels: list[str], batched: bool, output: str) -> np.ndarray:
    """Per batch row (or for the whole tensor), the k largest values, largest first, as BYTES."""
    if array.dtype.kind not in "biuf":
        raise InvalidArgumentError(f"output '{output}' of type {array.dtype} can not be classified")
    rows = array.reshape(array.shape[0], -1) if batched and array.ndim else array.reshape(1, -1)
    count = min(k, rows.shape[1])
    order = np.argsort(-rows.astype(np.float64), axis=1, kind="stable")[:, :count]
    result = np.empty((rows.shape[0], count), dtype=np.object_)
    for row, indices in enumerate(order):
        for column, index in enumerate(indices):
            value = rows[row, index]
            # As Triton prints them (std::to_string): 6 decimals for floats, integers as they are.
            text = f"{float(value):f}" if rows.dtype.kind == "f" else str(int(value))
            text += f":{int(index)}"
            if int(index) < len(labels):
                text += f":{labels[int(index)]}"
            result[row, column] = text.encode()
    return result if batched else result.reshape(count)
