"""An arena's free ranges: first fit, and ranges given back merged with their free neighbours."""

from __future__ import annotations

import itertools

from geserve.free_ranges import give_back, take


def test_first_fit_splits_a_range_and_takes_an_exact_one_whole() -> None:
    free = [(0, 64), (128, 256)]
    assert take(free, 128) == 128 and free == [(0, 64), (256, 128)]
    assert take(free, 64) == 0 and free == [(256, 128)]
    assert take(free, 256) is None and free == [(256, 128)]


def test_ranges_given_back_in_any_order_merge_into_the_whole() -> None:
    for order in itertools.permutations(range(4)):
        free = [(0, 400)]
        taken = [take(free, 100) for _ in range(4)]
        assert taken == [0, 100, 200, 300] and free == []
        for index in order:
            give_back(free, index * 100, 100)
            assert free == sorted(free) and all(a + n < b for (a, n), (b, _) in itertools.pairwise(free))
        assert free == [(0, 400)], order


def test_a_range_between_two_held_ones_stays_apart() -> None:
    free: list[tuple[int, int]] = []
    give_back(free, 100, 50)
    give_back(free, 300, 50)
    assert free == [(100, 50), (300, 50)]
    give_back(free, 150, 150)
    assert free == [(100, 250)]
