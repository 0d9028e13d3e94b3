"""Implicit state of a sequence model's slots, kept in the worker next to its instance between steps."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from geserve.backends.base import RequestResult
from geserve.errors import GeserveError
from geserve.repository.sequence import StateSpec
from geserve.workers.messages import SEQUENCE_END, SEQUENCE_READY, SEQUENCE_START, RequestInfo


class SlotStates:
    """Each slot's states: fed to a batch as the state inputs (the initial value at START and for the padding
    of empty slots), replaced by the state outputs it returns, dropped once the sequence's END ran."""

    def __init__(self, specs: tuple[StateSpec, ...]) -> None:
        self._specs = specs
        self._held: dict[int, dict[str, np.ndarray]] = {}  # slot -> state input name -> its value
        self.output_names = tuple(spec.output_name for spec in specs)

    def __bool__(self) -> bool:
        return bool(self._specs)

    def feed(self, inputs: Mapping[str, np.ndarray], requests: Sequence[RequestInfo]) -> dict[str, np.ndarray]:
        """The batch's inputs with every state input added, each request's rows from its slot."""
        fed = dict(inputs)
        for spec in self._specs:
            parts = [self._current(spec, info) for info in requests]
            fed[spec.input_name] = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return fed

    def _current(self, spec: StateSpec, info: RequestInfo) -> np.ndarray:
        continuing = info.sequence_flags & SEQUENCE_READY and not info.sequence_flags & SEQUENCE_START
        held = self._held.get(info.slot, {}).get(spec.input_name) if continuing else None
        return spec.initial if held is None else held

    def keep_whole(self, outputs: dict[str, np.ndarray], requests: Sequence[RequestInfo]) -> None:
        """Keep each request's rows of the state outputs of a batch run as one tensor per output; state outputs
        no request asked for leave `outputs`."""
        row = 0
        for info in requests:
            own = {
                name: outputs[name] if len(requests) == 1 else outputs[name][row : row + info.rows]
                for name in self.output_names
                if name in outputs
            }
            self._keep(info, own)
            row += info.rows
        wanted = {name for info in requests for name in info.output_names}
        for name in self.output_names:
            if name not in wanted:
                outputs.pop(name, None)

    def keep_own(self, results: Sequence[RequestResult], requests: Sequence[RequestInfo]) -> None:
        """Keep the state outputs of each request's own result (python models answer request by request)."""
        for info, result in zip(requests, results, strict=False):
            if isinstance(result, GeserveError):
                continue
            self._keep(info, {name: result[name] for name in self.output_names if name in result})
            for name in self.output_names:
                if name not in info.output_names:
                    result.pop(name, None)

    def _keep(self, info: RequestInfo, states: dict[str, np.ndarray]) -> None:
        if info.slot < 0 or not info.sequence_flags & SEQUENCE_READY:
            return  # not a sequence request, or the padding of an empty slot
        if info.sequence_flags & SEQUENCE_END:
            self._held.pop(info.slot, None)
            return
        held = self._held.setdefault(info.slot, {})
        for spec in self._specs:
            if spec.output_name in states:
                # A copy: the batch's outputs live in shared memory the next batch reuses.
                held[spec.input_name] = np.array(states[spec.output_name], copy=True)
