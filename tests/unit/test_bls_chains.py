"""BLS call chains: how a batch's chains merge, and which requests could only wait for themselves."""

from __future__ import annotations

import pytest

from geserve.core.calls import check_cycle
from geserve.errors import UnsupportedError
from geserve.types import merge_chains

A, B = ("a", 1), ("b", 1)


def test_a_merged_chain_holds_each_version_as_often_as_the_chain_that_holds_it_most() -> None:
    assert merge_chains([]) == ()
    assert merge_chains([(A,), (A,)]) == (A,)
    assert merge_chains([(A, B), (B, A, B)]) == (A, B, B)
    assert sorted(merge_chains([(A, A), (B,)])) == [A, A, B]


def test_a_request_is_refused_once_its_chain_holds_every_instance() -> None:
    check_cycle("a", 1, 1, ())  # a client's request
    check_cycle("a", 1, 2, (A,))  # the other instance can run it
    check_cycle("a", 2, 1, (A,))  # another version has instances of its own
    check_cycle("b", 1, 1, (A,))
    check_cycle("a", 1, None, (A, A))  # an ensemble: no instances of its own
    with pytest.raises(UnsupportedError, match=r"BLS call cycle: 'a' -> 'b' -> 'a'; every instance of model 'a'"):
        check_cycle("a", 1, 1, (A, B))
    with pytest.raises(UnsupportedError, match=r"version 1 \(2\) is waiting"):
        check_cycle("a", 1, 2, (A, B, A))
