"""Triton's rate limiter (--rate-limit=execution_count): an instance runs a batch once it holds its resources."""

# As Triton's core rate_limiter.cc: each instance group may name resources (per device, or global to the server)
# and a priority; an instance takes its resources before it runs a batch and gives them back after. Instances
# waiting to run are served one at a time in order of their scaled priority (executions so far times the
# priority, 1 at least: lowest first), only the first of them tried, so one that needs many resources is not
# passed over for ever. A resource's copies are the most any instance names, unless --rate-limit-resource says.

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass

from geserve._generated import model_config_pb2 as mc
from geserve.errors import InvalidArgumentError, ModelLoadError

EXECUTION_COUNT = "execution_count"  # --rate-limit's value that turns it on (off: Triton's default)
GLOBAL_DEVICE = -2  # Triton's GLOBAL_RESOURCE_KEY
EVERY_DEVICE = -1  # a --rate-limit-resource without a device: each device has that many


@dataclass(frozen=True, slots=True)
class Demand:
    """What one instance holds while it runs: (resource, device or GLOBAL_DEVICE) -> copies; and its priority."""

    resources: Mapping[tuple[str, int], int]
    priority: int


def parse_resource(text: str) -> tuple[str, int, int]:
    """--rate-limit-resource <name>:<count>[:<device>] -> (name, device or EVERY_DEVICE, count)."""
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3) or not parts[0]:
            raise ValueError
        count = int(parts[1])
        device = int(parts[2]) if len(parts) == 3 else EVERY_DEVICE
        if count < 0 or device < EVERY_DEVICE:
            raise ValueError
    except ValueError:
        raise InvalidArgumentError(
            "--rate-limit-resource option format is '<resource_name>:<count>:<device>' or "
            f"'<resource_name>:<count>'. Got {text}"
        ) from None
    return parts[0], device, count


def demand_of(group: mc.ModelInstanceGroup, device: int) -> Demand:
    """An instance of `group` on `device`: its resources as keys of the limiter's pool."""
    resources: dict[tuple[str, int], int] = {}
    for resource in group.rate_limiter.resources:
        key = (resource.name, GLOBAL_DEVICE if getattr(resource, "global") else device)
        resources[key] = resources.get(key, 0) + resource.count
    return Demand(resources, group.rate_limiter.priority)


def check_config(config: mc.ModelConfig) -> None:
    """Triton's refusal of a resource a model names both global and per device."""
    kinds: dict[str, set[bool]] = {}
    for group in config.instance_group:
        for resource in group.rate_limiter.resources:
            kinds.setdefault(resource.name, set()).add(bool(getattr(resource, "global")))
    for name, found in kinds.items():
        if len(found) > 1:
            raise ModelLoadError(
                f'Resource "{name}" is present as both global and device-specific resource in the model configuration.'
            )


class RateLimiter:
    """The server's resources and the instances waiting for them, on the engine's loop."""

    def __init__(self, explicit: Iterable[tuple[str, int, int]] = ()) -> None:
        # --rate-limit-resource: the same resource and device twice keeps the smaller count, as Triton.
        self._explicit: dict[tuple[str, int], int] = {}
        for name, device, count in explicit:
            key = (name, device)
            self._explicit[key] = min(count, self._explicit.get(key, count))
        self._demands: dict[object, Demand] = {}
        self._runs: dict[object, int] = {}  # executions so far, by instance
        self._in_use: dict[tuple[str, int], int] = {}
        self._waiting: list[tuple[int, object, asyncio.Future[None]]] = []  # (arrival, instance, its turn)
        self._order = itertools.count()

    def register(self, instance: object, demand: Demand) -> None:
        """An instance that will run batches; refused (as Triton refuses it at load) when a resource it needs has
        fewer copies than it names."""
        for key, count in demand.resources.items():
            limit = self._explicit_limit(key)
            if limit is not None and limit < count:
                raise ModelLoadError(
                    f'Resource count for "{key[0]}" is limited to {limit} which will prevent scheduling of one or '
                    f"more model instances, the minimum required count is {count}"
                )
        self._demands[instance] = demand
        self._runs.setdefault(instance, 0)

    def unregister(self, instance: object) -> None:
        self._demands.pop(instance, None)
        self._runs.pop(instance, None)

    def capacity(self, key: tuple[str, int]) -> int:
        """The copies of a resource: as --rate-limit-resource says, else the most any registered instance names."""
        limit = self._explicit_limit(key)
        if limit is not None:
            return limit
        return max((demand.resources.get(key, 0) for demand in self._demands.values()), default=0)

    def _explicit_limit(self, key: tuple[str, int]) -> int | None:
        name, device = key
        if device == GLOBAL_DEVICE:  # a global resource: the largest count given for its name, whatever the device
            given = [count for (named, _), count in self._explicit.items() if named == name]
        else:
            given = [
                count for (named, on), count in self._explicit.items() if named == name and on in (device, EVERY_DEVICE)
            ]
        return max(given) if given else None

    @contextlib.asynccontextmanager
    async def held(self, instance: object) -> AsyncIterator[None]:
        """Wait for the instance's turn and resources, hold them while the block runs, then give them back."""
        demand = self._demands.get(instance)
        if demand is None:  # not rate limited (unregistered while a batch was on its way)
            yield
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((next(self._order), instance, future))
        self._allocate()
        try:
            await future
        except BaseException:
            if future.done() and not future.cancelled():
                self._give_back(demand)  # granted as it was cancelled
            else:
                future.cancel()
                self._allocate()
            raise
        try:
            yield
        finally:
            self._give_back(demand)

    def _give_back(self, demand: Demand) -> None:
        for key, count in demand.resources.items():
            self._in_use[key] -= count
        self._allocate()

    def _allocate(self) -> None:
        """Grant the first waiting instance its resources while they are free (only the first: Triton's order). The
        first is the one of lowest scaled priority now (executions so far times the priority), the earliest among
        equals."""
        self._waiting = [entry for entry in self._waiting if not entry[2].done()]  # cancelled while waiting
        while self._waiting:
            first = min(self._waiting, key=self._rank)
            _, instance, future = first
            demand = self._demands.get(instance, Demand({}, 0))
            if any(self._in_use.get(key, 0) + count > self.capacity(key) for key, count in demand.resources.items()):
                return
            self._waiting.remove(first)
            for key, count in demand.resources.items():
                self._in_use[key] = self._in_use.get(key, 0) + count
            self._runs[instance] = self._runs.get(instance, 0) + 1
            future.set_result(None)

    def _rank(self, entry: tuple[int, object, asyncio.Future[None]]) -> tuple[int, int]:
        arrival, instance, _ = entry
        demand = self._demands.get(instance)
        return self._runs.get(instance, 0) * max(demand.priority if demand else 0, 1), arrival
