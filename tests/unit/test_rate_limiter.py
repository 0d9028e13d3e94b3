"""The rate limiter as Triton's rate_limiter.md describes it: resources held while running, priority order."""

from __future__ import annotations

import asyncio

import pytest

from geserve._generated import model_config_pb2 as mc
from geserve.errors import InvalidArgumentError, ModelLoadError
from geserve.workers.rate_limiter import (
    EVERY_DEVICE,
    GLOBAL_DEVICE,
    Demand,
    RateLimiter,
    check_config,
    demand_of,
    parse_resource,
)


def _group(*resources: tuple[str, int, bool], priority: int = 0) -> mc.ModelInstanceGroup:
    group = mc.ModelInstanceGroup()
    for name, count, is_global in resources:
        resource = group.rate_limiter.resources.add(name=name, count=count)
        setattr(resource, "global", is_global)
    group.rate_limiter.priority = priority
    return group


def test_resources_are_keyed_by_device_or_global() -> None:
    demand = demand_of(_group(("R1", 2, False), ("R2", 1, True), priority=3), device=1)
    assert demand == Demand({("R1", 1): 2, ("R2", GLOBAL_DEVICE): 1}, 3)


def test_a_resource_both_global_and_per_device_is_refused_with_tritons_text() -> None:
    config = mc.ModelConfig(name="m")
    config.instance_group.append(_group(("R", 1, False)))
    config.instance_group.append(_group(("R", 1, True)))
    with pytest.raises(ModelLoadError) as error:
        check_config(config)
    assert error.value.message == (
        'Resource "R" is present as both global and device-specific resource in the model configuration.'
    )


def test_the_resource_flag_parses_as_tritons() -> None:
    assert parse_resource("R1:10") == ("R1", EVERY_DEVICE, 10)
    assert parse_resource("R1:4:2") == ("R1", 2, 4)
    for bad in ("R1", "R1:x", ":3", "R1:1:2:3"):
        with pytest.raises(InvalidArgumentError, match="option format is"):
            parse_resource(bad)


def test_copies_default_to_the_most_any_instance_names_and_the_flag_overrides() -> None:
    limiter = RateLimiter()
    limiter.register("a", Demand({("R", 0): 2}, 0))
    limiter.register("b", Demand({("R", 0): 3}, 0))
    assert limiter.capacity(("R", 0)) == 3
    limited = RateLimiter([("R", EVERY_DEVICE, 5), ("R", 1, 2), ("G", 0, 7)])
    assert limited.capacity(("R", 0)) == 5 and limited.capacity(("R", 1)) == 5
    assert limited.capacity(("G", GLOBAL_DEVICE)) == 7
    with pytest.raises(ModelLoadError) as error:
        RateLimiter([("R", EVERY_DEVICE, 1)]).register("a", Demand({("R", 0): 2}, 0))
    assert error.value.message == (
        'Resource count for "R" is limited to 1 which will prevent scheduling of one or more model instances, '
        "the minimum required count is 2"
    )


def test_instances_sharing_a_resource_run_one_at_a_time_and_others_run_beside_them() -> None:
    async def scenario() -> list[str]:
        limiter = RateLimiter()
        for name in ("a", "b"):
            limiter.register(name, Demand({("NPU", 0): 1}, 0))
        limiter.register("free", Demand({}, 0))
        events: list[str] = []

        async def run(name: str) -> None:
            async with limiter.held(name):
                events.append(f"{name} start")
                await asyncio.sleep(0.01)
                events.append(f"{name} end")

        await asyncio.gather(run("a"), run("b"))
        await asyncio.gather(run("a"), run("free"))
        return events

    events = asyncio.run(scenario())
    assert events[:4] == ["a start", "a end", "b start", "b end"]
    assert events[4:6] == ["a start", "free start"]  # a resource-free instance is not held up


def test_a_lower_priority_instance_gets_fewer_turns() -> None:
    """Priority 2 gets half the turns of priority 1 (scaled priority = executions x priority, lowest first)."""

    async def scenario() -> list[str]:
        limiter = RateLimiter()
        limiter.register("one", Demand({("R", 0): 1}, 1))
        limiter.register("two", Demand({("R", 0): 1}, 2))
        order: list[str] = []

        async def worker(name: str) -> None:
            for _ in range(12):
                async with limiter.held(name):
                    order.append(name)
                    await asyncio.sleep(0)

        # Two batches of each instance on their way at any time: both instances always wait for their turn.
        await asyncio.gather(*(worker(name) for name in ("one", "two") for _ in range(2)))
        return order

    order = asyncio.run(scenario())
    first = order[:12]
    assert first.count("one") == 8 and first.count("two") == 4, order


def test_a_waiter_cancelled_gives_its_place_and_its_resources_up() -> None:
    async def scenario() -> bool:
        limiter = RateLimiter()
        for name in ("a", "b", "c"):
            limiter.register(name, Demand({("R", 0): 1}, 0))
        release = asyncio.Event()

        async def hold(name: str) -> None:
            async with limiter.held(name):
                await release.wait()

        holder = asyncio.create_task(hold("a"))
        await asyncio.sleep(0)
        waiter = asyncio.create_task(hold("b"))
        await asyncio.sleep(0)
        waiter.cancel()
        late = asyncio.create_task(hold("c"))
        await asyncio.sleep(0)
        release.set()
        await asyncio.wait_for(asyncio.gather(holder, late), 1)
        return waiter.cancelled()

    assert asyncio.run(scenario())
