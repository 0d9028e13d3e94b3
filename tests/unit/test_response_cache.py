"""The response cache: its key, LRU order and byte bound, Triton's accounting and refusals, and its flags."""

from __future__ import annotations

import asyncio
import tracemalloc
from typing import Any

import numpy as np
import pytest

from geserve._generated import model_config_pb2 as mc
from geserve.batching.request import ScheduledRequest, ScheduledResponse
from geserve.cache_config import parse_cache_flags
from geserve.cli import parse_settings
from geserve.core import response_cache
from geserve.core.response_cache import PackedResponse, ResponseCache, pack, request_key
from geserve.core.stats import ModelStats
from geserve.errors import InvalidArgumentError, ModelLoadError
from geserve.residency import SharedTensor


def request(outputs: tuple[str, ...] = ("OUT",), **inputs: np.ndarray) -> ScheduledRequest:
    return ScheduledRequest({name: SharedTensor.local(array) for name, array in inputs.items()}, outputs)


FOUR = np.arange(4, dtype=np.float32)


# -- the key ----------------------------------------------------------------------------------------------


def test_the_key_is_the_same_for_the_same_model_version_inputs_and_outputs() -> None:
    first = request_key("m", 1, request(A=FOUR.copy(), B=np.array([b"x", b"yz"], dtype=object)))
    again = request_key("m", 1, request(B=np.array([b"x", b"yz"], dtype=object), A=FOUR[::1].copy()))
    assert first == again  # inputs are taken by name, whatever order they came in


@pytest.mark.parametrize(
    ("model", "version", "changed"),
    [
        ("other", 1, request(A=FOUR)),  # model name
        ("m", 2, request(A=FOUR)),  # version
        ("m", 1, request(C=FOUR)),  # input name
        ("m", 1, request(A=FOUR + 1)),  # contents
        ("m", 1, request(A=FOUR.view(np.int32))),  # same bytes, another datatype
        ("m", 1, request(A=FOUR.reshape(2, 2))),  # same bytes, another shape
        ("m", 1, request(("OUT", "OTHER"), A=FOUR)),  # other outputs asked for
    ],
)
def test_the_key_changes_with_each_part_of_the_request(model: str, version: int, changed: ScheduledRequest) -> None:
    assert request_key("m", 1, request(A=FOUR)) != request_key(model, version, changed)


def test_each_load_of_a_version_has_keys_of_its_own() -> None:
    assert request_key("m", 1, request(A=FOUR), load=1) != request_key("m", 1, request(A=FOUR), load=2)


def test_bytes_elements_are_delimited_in_the_key() -> None:
    split = np.array([b"ab", b"c"], dtype=object)
    other = np.array([b"a", b"bc"], dtype=object)
    assert request_key("m", 1, request(S=split)) != request_key("m", 1, request(S=other))


def test_a_non_contiguous_input_is_keyed_by_its_values() -> None:
    strided = np.arange(8, dtype=np.float32)[::2]
    assert request_key("m", 1, request(A=strided)) == request_key("m", 1, request(A=strided.copy()))


# -- LRU and the byte bound -------------------------------------------------------------------------------


def entry(value: float, elements: int = 4) -> PackedResponse:
    return pack({"OUT": np.full(elements, value, dtype=np.float32)})


def test_the_least_recently_used_entry_is_evicted_first() -> None:
    size = entry(1.0).cost
    cache = ResponseCache(3 * size)
    for key in (b"a", b"b", b"c"):
        assert cache.insert(key, entry(1.0))
    assert cache.lookup(b"a") is not None  # a is now the most recently used
    assert cache.insert(b"d", entry(1.0))
    assert cache.lookup(b"b") is None
    assert all(cache.lookup(key) is not None for key in (b"a", b"c", b"d"))
    assert (len(cache), cache.evictions, cache.used_bytes) == (3, 1, 3 * size)


def test_entries_never_hold_more_bytes_than_the_cache() -> None:
    small = entry(1.0).cost
    cache = ResponseCache(small * 2 + small // 2)
    for index in range(10):
        assert cache.insert(bytes([index]), entry(float(index)))
        assert cache.used_bytes <= cache.capacity_bytes
    assert len(cache) == 2 and cache.evictions == 8


def test_an_entry_larger_than_the_cache_is_not_inserted_and_evicts_nothing() -> None:
    small = entry(1.0)
    cache = ResponseCache(small.cost)
    assert cache.insert(b"small", small)
    assert not cache.insert(b"big", entry(2.0, elements=64))
    assert cache.lookup(b"big") is None and cache.lookup(b"small") is not None
    assert cache.evictions == 0


def test_an_entry_costs_its_data_and_what_holds_it() -> None:
    outputs = {"OUT": np.zeros((2, 3), dtype=np.float32), "S": np.array([b"abc", b""], dtype=object)}
    packed = pack(outputs)
    assert len(packed.blob) == 32 + 16  # each output's data (BYTES length-prefixed), aligned to 16 bytes
    assert packed.cost > len(packed.blob) + 200  # the key, the table slot, the layout: not only the data
    found = ResponseCache(1 << 20)
    found.insert(b"k", packed)
    hit = found.lookup(b"k")
    assert hit is not None
    np.testing.assert_array_equal(hit["OUT"].array, outputs["OUT"])
    assert list(hit["S"].array) == [b"abc", b""] and hit["S"].array.shape == (2,)


def test_a_cache_of_small_entries_holds_about_its_size_in_memory() -> None:
    """A cache filled with thousands of small responses: what it holds, traced, stays within 1.5 times its size (each
    entry's real cost is counted, not only its data; counting the data alone, an 8 MiB cache held 103 MiB)."""
    capacity = 2 << 20
    cache = ResponseCache(capacity)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for index in range(16_000):
            key = request_key("m", 1, request(A=np.array([index], dtype=np.int64)))
            cache.insert(key, pack({"OUT": np.full(4, index, dtype=np.float32), "N": np.array([index])}))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert cache.evictions > 0, "the cache never filled: the test proves nothing"
    assert held <= 1.5 * capacity, f"{held / capacity:.2f} times the cache's size"


def test_cached_outputs_are_copies_that_no_one_can_change() -> None:
    produced = np.arange(4, dtype=np.int32)
    cache = ResponseCache(1 << 20)
    cache.insert(b"k", pack({"OUT": produced}))
    produced[:] = -1  # the worker's arena is reused by the next batch
    found = cache.lookup(b"k")
    assert found is not None
    np.testing.assert_array_equal(found["OUT"].array, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="read-only"):
        found["OUT"].array[0] = 7
    found.pop("OUT")  # the dict a hit gets is its own
    assert cache.lookup(b"k") is not None


# -- a request through the cache: Triton's accounting ----------------------------------------------------------


class CountingScheduler:
    def __init__(self, fail: bool = False) -> None:
        self.executions = 0
        self.fail = fail

    async def execute(self, scheduled: ScheduledRequest) -> ScheduledResponse:
        self.executions += 1
        if self.fail:
            raise RuntimeError("model failed")
        return ScheduledResponse({"OUT": SharedTensor.local(scheduled.inputs["A"].array * 2)})


class Version:
    """What the cache reads of a ModelVersion."""

    def __init__(self, cache: ResponseCache | None, scheduler: CountingScheduler, platform: str = "") -> None:
        self.name = "m"
        self.version = 1
        self.config = mc.ModelConfig(name="m", platform=platform)
        self.response_cache: ResponseCache | None = None
        self.scheduler = scheduler
        self.stats = ModelStats()
        if cache is not None:
            cache.attach(self)  # type: ignore[arg-type]


def run(version: Any, scheduled: ScheduledRequest) -> ScheduledResponse:
    return asyncio.run(response_cache.execute(version, scheduled))


def test_a_hit_skips_the_model_and_counts_as_triton_does() -> None:
    scheduler = CountingScheduler()
    version = Version(ResponseCache(1 << 20), scheduler)
    first = run(version, request(A=FOUR))
    second = run(version, request(A=FOUR.copy()))
    np.testing.assert_array_equal(second.outputs["OUT"].array, first.outputs["OUT"].array)
    assert scheduler.executions == 1
    stats = version.stats
    assert (stats.cache_hit.count, stats.cache_miss.count) == (1, 1)
    # the scheduler records the miss's own success; the hit adds one, with no inference and no execution
    assert stats.success.count == 1 and stats.inference_count == 0 and stats.execution_count == 0
    assert stats.queue.count == stats.compute_infer.count == 1 and stats.compute_infer.ns == 0
    run(version, request(A=FOUR + 1))
    assert scheduler.executions == 2 and stats.cache_miss.count == 2


def test_a_reloaded_version_does_not_get_what_the_old_load_computed() -> None:
    cache = ResponseCache(1 << 20)
    old = Version(cache, CountingScheduler())
    run(old, request(A=FOUR))
    new_scheduler = CountingScheduler()
    run(Version(cache, new_scheduler), request(A=FOUR))
    assert new_scheduler.executions == 1
    run(old, request(A=FOUR))
    assert old.stats.cache_hit.count == 1  # the old load keeps its own entries while it drains


def test_an_ensembles_entries_end_when_any_model_loads() -> None:
    # A step model can reload (or gain a version) without its ensemble: what the ensemble cached may be stale.
    cache = ResponseCache(1 << 20)
    ensemble_scheduler, plain_scheduler = CountingScheduler(), CountingScheduler()
    ensemble = Version(cache, ensemble_scheduler, platform="ensemble")
    plain = Version(cache, plain_scheduler)
    for version in (ensemble, plain, ensemble, plain):
        run(version, request(A=FOUR))
    assert (ensemble_scheduler.executions, plain_scheduler.executions) == (1, 1)
    cache.note_load()
    run(ensemble, request(A=FOUR))
    run(plain, request(A=FOUR))
    assert ensemble_scheduler.executions == 2  # run again on the steps loaded now
    assert plain_scheduler.executions == 1  # a model's own entries end only with its own reload


def test_a_large_bytes_input_counts_its_strings_not_its_pointers() -> None:
    one_big_string = np.array([b"x" * (response_cache.OFFLOAD_BYTES + 1)], dtype=object)
    assert one_big_string.nbytes == 8
    assert response_cache._total_bytes({"S": one_big_string}) > response_cache.OFFLOAD_BYTES
    many_strings = np.array([b""] * (response_cache._MANY_ELEMENTS + 1), dtype=object)
    assert response_cache._total_bytes({"S": many_strings}) > response_cache.OFFLOAD_BYTES
    assert response_cache._total_bytes({"S": np.array([b"ab", b"c"], dtype=object)}) == 3


def test_without_the_cache_every_request_runs_the_model() -> None:
    scheduler = CountingScheduler()
    version = Version(None, scheduler)
    run(version, request(A=FOUR))
    run(version, request(A=FOUR))
    assert scheduler.executions == 2 and version.stats.cache_hit.count == 0


def test_a_failing_request_is_not_cached() -> None:
    scheduler = CountingScheduler(fail=True)
    cache = ResponseCache(1 << 20)
    version = Version(cache, scheduler)
    for _ in range(2):
        with pytest.raises(RuntimeError):
            run(version, request(A=FOUR))
    assert scheduler.executions == 2 and len(cache) == 0


def test_a_broken_cache_does_not_fail_the_request(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: object) -> bytes:
        raise MemoryError("no memory for the key")

    monkeypatch.setattr(response_cache, "request_key", broken)
    scheduler = CountingScheduler()
    answered = run(Version(ResponseCache(1 << 20), scheduler), request(A=FOUR))
    np.testing.assert_array_equal(answered.outputs["OUT"].array, FOUR * 2)
    assert scheduler.executions == 1


def test_large_inputs_are_keyed_off_the_event_loop_with_the_same_key() -> None:
    big = np.ones(response_cache.OFFLOAD_BYTES // 4 + 1, dtype=np.float32)
    scheduler = CountingScheduler()
    version = Version(ResponseCache(1 << 24), scheduler)
    run(version, request(A=big))
    run(version, request(A=big.copy()))
    assert scheduler.executions == 1 and version.stats.cache_hit.count == 1


# -- refusals at load -------------------------------------------------------------------------------------


def config(text: str) -> mc.ModelConfig:
    from google.protobuf import text_format

    return text_format.Parse(f'name: "m"\nresponse_cache {{ enable: true }}\n{text}', mc.ModelConfig())


def test_decoupled_and_sequence_models_cannot_enable_the_cache() -> None:
    with pytest.raises(ModelLoadError, match="Response Cache does not currently support model 'm' with a 'decoupled'"):
        response_cache.check_config(config("model_transaction_policy { decoupled: true }"))
    with pytest.raises(ModelLoadError, match="does not currently support model 'm' with sequence batching"):
        response_cache.check_config(config("sequence_batching {}"))
    response_cache.check_config(config("dynamic_batching {}"))
    plain = config("model_transaction_policy { decoupled: true }")
    plain.response_cache.enable = False
    response_cache.check_config(plain)


# -- the flags --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["--cache-config=local,size=1048576"],
        ["--cache-config", "local,size=1048576"],
        ["--cache-config=local,size=12", "--cache-config=local,size=1048576"],  # the last setting wins
        ["--response-cache-byte-size=1048576"],
        ["--response-cache-byte-size", "1048576"],
    ],
)
def test_the_local_cache_size_flags(argv: list[str]) -> None:
    assert parse_settings(["--model-repository=/m", *argv]).server.response_cache_bytes == 1048576


def test_no_cache_by_default_and_the_deprecated_flag_is_warned() -> None:
    assert parse_settings(["--model-repository=/m"]).server.response_cache_bytes == 0
    warnings = parse_settings(["--model-repository=/m", "--response-cache-byte-size=64"]).server.warnings
    assert any("'--response-cache-byte-size' has been deprecated" in w and "local,size=64" in w for w in warnings)
    assert not any(
        "cache" in w for w in parse_settings(["--model-repository=/m", "--cache-config=local,size=64"]).server.warnings
    )


@pytest.mark.parametrize(
    ("entries", "sizes", "message"),
    [
        (["redis,host=localhost", "redis,port=6379"], [], "the 'redis' cache is not available"),
        (["local,size=64", "redis,host=h"], [], "multiple cache configurations are not supported"),
        (["local,size=64"], ["64"], "Incompatible flags --response-cache-byte-size and --cache-config both provided"),
        (["size=64"], [], "No cache specified. --cache-config option format is <cache name>,<setting>=<value>"),
        (["local,size"], [], "--cache-config option format is '<cache name>,<setting>=<value>'. Got local,size"),
        (["local,host=x"], [], "the local cache has no setting 'host'"),
        (["local,size=0"], [], "needs a size of at least one byte"),
        (["local,size=-5"], [], "must be a whole number of bytes"),
        (["local,size=1MB"], [], "must be a whole number of bytes"),
        ([], ["0"], "--response-cache-byte-size=0: the local cache needs a size"),
        ([], ["lots"], "--response-cache-byte-size=lots: the cache size must be a whole number of bytes"),
    ],
)
def test_bad_cache_flags_are_refused(entries: list[str], sizes: list[str], message: str) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        parse_cache_flags(entries, sizes)
    assert message in raised.value.message
    assert parse_cache_flags(["local,size=64"], []) == (64, [])  # a good one still works


def test_a_refused_cache_flag_exits_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_settings(["--model-repository=/m", "--cache-config=redis,host=localhost"])
    assert exited.value.code == 2
    assert "the 'redis' cache is not available" in capsys.readouterr().err
