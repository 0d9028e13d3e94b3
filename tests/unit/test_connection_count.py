"""The HTTP connection count shared by protocol processes: one slot per process in an anonymous shared mapping."""

from __future__ import annotations

import os

from geserve.http.connections import ListeningHere
from geserve.multiprocess.connection_count import SharedConnectionCount, SharedListening, create_counts, forget_listener


def test_totals_add_every_process_and_count_this_one_as_it_says() -> None:
    counts = create_counts(3)
    first, third = SharedConnectionCount(counts, 0), SharedConnectionCount(counts, 2)
    first.update(4)
    third.update(5)
    assert first.total(4) == 9 and third.total(5) == 9
    # Before it records a change, a process's own figure is the one it passes.
    assert first.total(6) == 11


def test_a_restarted_process_starts_from_zero_and_the_others_keep_theirs() -> None:
    counts = create_counts(2)
    first, second = SharedConnectionCount(counts, 0), SharedConnectionCount(counts, 1)
    first.update(2)
    second.update(7)
    successor = SharedConnectionCount(counts, 1)  # its predecessor's connections died with it
    assert successor.total(0) == 2 and first.total(2) == 2


def test_a_forked_process_writes_the_counts_its_parent_reads() -> None:
    counts = create_counts(2)
    parent = SharedConnectionCount(counts, 0)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        SharedConnectionCount(counts, 1).update(3)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert parent.total(1) == 4


def test_separate_servers_do_not_share_counts() -> None:
    one, other = create_counts(2), create_counts(2)
    SharedConnectionCount(one, 0).update(9)
    assert SharedConnectionCount(other, 1).total(0) == 0


def test_the_socket_is_closed_everywhere_only_when_every_process_closed_it() -> None:
    counts = create_counts(2)
    first, second = SharedListening(counts, 0), SharedListening(counts, 1)
    assert first.closed_everywhere()  # nobody listens yet
    first.opened()
    second.opened()
    first.closed()
    assert not first.closed_everywhere() and not second.closed_everywhere()
    second.closed()
    assert first.closed_everywhere()
    # Listening flags and connection counts are separate slots of the one mapping.
    SharedConnectionCount(counts, 0).update(3)
    assert first.closed_everywhere()


def test_a_dead_process_no_longer_holds_the_socket() -> None:
    counts = create_counts(2)
    survivor, dead = SharedListening(counts, 0), SharedListening(counts, 1)
    survivor.opened()
    dead.opened()
    survivor.closed()
    forget_listener(counts, 1)  # the supervisor, reaping it
    assert survivor.closed_everywhere()


def test_one_process_listening_alone() -> None:
    here = ListeningHere()
    here.opened()
    assert not here.closed_everywhere()
    here.closed()
    assert here.closed_everywhere()
