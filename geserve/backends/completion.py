"""The part of config auto-complete every backend shares: a declared tensor's type and dims from the model file's."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from geserve._generated import model_config_pb2 as mc
from geserve.codecs import dtypes


class FileTensor(Protocol):
    """A tensor as a model file describes it (an ONNX graph's input, an `.om` output, ...)."""

    @property
    def datatype(self) -> dtypes.DataType | None: ...

    @property
    def dims(self) -> tuple[int, ...]: ...  # the batch dim first when the model batches; -1 where unknown


def complete_tensors(declared: Iterable[Any], find: Callable[[str], FileTensor | None], skip: int) -> None:
    """Fill each declared tensor's data type and dims that the config leaves out, from the model file's tensor
    of that name (`skip` leading dims are the batch). A tensor with nothing past the batch is declared [1] with
    an empty reshape, as Triton completes it. Unknown names are left for the backend's check to report."""
    for tensor in declared:
        found = find(tensor.name)
        if found is None:
            continue
        if tensor.data_type == mc.TYPE_INVALID and found.datatype is not None:
            tensor.data_type = found.datatype.config
        if tensor.dims:
            continue
        if len(found.dims) > skip:
            tensor.dims.extend(found.dims[skip:])
        elif len(found.dims) == skip:
            tensor.dims.append(1)
            tensor.reshape.SetInParent()
