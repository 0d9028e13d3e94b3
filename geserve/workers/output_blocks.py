"""OutputBlocks: where a batch's outputs go in shared memory, and which rows of them are each request's."""

from __future__ import annotations

import numpy as np

from geserve.backends.base import RequestResult
from geserve.codecs import dtypes
from geserve.errors import GeserveError
from geserve.workers.messages import OutputBlock, PlacedResult, RequestInfo, RowRange
from geserve.workers.output_arena import InPlaceOutputs
from geserve.workers.shm import TensorLayout


class OutputBlocks:
    """A batch's outputs as blocks in shared memory, and each request's outputs as row ranges of them.
    One block per output holds every request's rows when the backend returned one tensor (the requests
    get consecutive views of it) or wrote it in place; per-request outputs (python models) are stacked
    into one block when their dims agree, else each is a block of its own (BYTES, ragged shapes)."""

    def __init__(self, datatypes: dict[str, str], in_place: InPlaceOutputs) -> None:
        self._datatypes = datatypes
        self._in_place = in_place
        self._blocks: list[OutputBlock | int] = []  # a block in place, or the layout entry to be written
        self.layout = TensorLayout()
        self._written: tuple[OutputBlock, ...] = ()

    def place(
        self, results: tuple[RequestResult, ...], whole: dict[str, np.ndarray], requests: tuple[RequestInfo, ...]
    ) -> tuple[PlacedResult, ...]:
        """Blocks for `whole` (a batch's outputs, each request's rows in turn) or else for the requests'
        own outputs, and every request's outputs as row ranges of them."""
        if whole:
            return self._place_whole(whole, requests)
        ranges: list[dict[str, RowRange]] = [{} for _ in results]
        by_name: dict[str, list[tuple[int, np.ndarray]]] = {}
        for index, result in enumerate(results):
            if not isinstance(result, GeserveError):
                for name, array in result.items():
                    by_name.setdefault(name, []).append((index, array))
        for name, entries in by_name.items():
            self._add_own(name, entries, ranges)
        return tuple(
            result if isinstance(result, GeserveError) else tuple(ranges[index][name] for name in result)
            for index, result in enumerate(results)
        )

    def _place_whole(self, whole: dict[str, np.ndarray], requests: tuple[RequestInfo, ...]) -> tuple[PlacedResult, ...]:
        """One block per output, in place where the backend wrote it there; each request has its rows of the
        outputs it asked for (a batch of one request has them whole, a model without a batch dimension too). A BYTES
        output's rows vary in size, so each request's rows of it are a block of their own."""
        if len(requests) == 1:
            blocks = {name: self._block(name, array) for name, array in whole.items()}
            return (tuple((blocks[name], 0, -1) for name in requests[0].output_names),)
        blocks = {name: self._block(name, array) for name, array in whole.items() if not _is_bytes(array)}
        placed: list[PlacedResult] = []
        first = 0
        for info in requests:
            ranges: list[RowRange] = []
            for name in info.output_names:
                if name in blocks:
                    ranges.append((blocks[name], first, info.rows))
                else:
                    ranges.append((self._block(name, whole[name][first : first + info.rows]), 0, -1))
            placed.append(tuple(ranges))
            first += info.rows
        return tuple(placed)

    def _block(self, name: str, array: np.ndarray) -> int:
        block = len(self._blocks)
        tensor = self._in_place.ref_of(name, array)
        if tensor is not None:
            self._blocks.append((name, tensor))
        else:
            self._blocks.append(self.layout.count)
            self.layout.add(name, self._datatype(name, array), [array])
        return block

    def _add_own(self, name: str, entries: list[tuple[int, np.ndarray]], ranges: list[dict[str, RowRange]]) -> None:
        """Per-request outputs of one name: stacked into one block when their dims agree, else one each."""
        arrays = [array for _, array in entries]
        datatype = self._datatype(name, arrays[0])
        if len(arrays) > 1 and datatype != "BYTES" and _stackable(arrays):
            block = len(self._blocks)
            self._blocks.append(self.layout.count)
            self.layout.add(name, datatype, arrays)
            first = 0
            for index, array in entries:
                ranges[index][name] = (block, first, int(array.shape[0]))
                first += int(array.shape[0])
            return
        for index, array in entries:
            ranges[index][name] = (self._block(name, array), 0, -1)

    def _datatype(self, name: str, array: np.ndarray) -> str:
        return self._datatypes.get(name) or dtypes.from_numpy(array.dtype).wire

    def written(self, blocks: tuple[OutputBlock, ...]) -> None:
        """Where the layout's entries were written, in its order."""
        self._written = blocks

    def refs(self) -> tuple[OutputBlock, ...]:
        return tuple(block if isinstance(block, tuple) else self._written[block] for block in self._blocks)


def _stackable(arrays: list[np.ndarray]) -> bool:
    """Whether the arrays are row blocks of one tensor: same dtype and the same dims after the first."""
    first = arrays[0]
    return (
        first.ndim > 0
        and all(a.ndim == first.ndim and a.shape[1:] == first.shape[1:] for a in arrays)
        and all(a.dtype == first.dtype for a in arrays)
    )


def _is_bytes(array: np.ndarray) -> bool:
    return array.dtype.kind == "O"
