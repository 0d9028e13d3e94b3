"""Ascend chips by architecture, as the platform files group them: which chip runs an `.om` made for another."""

from __future__ import annotations

import pytest

from geserve.atc.chips import compatible, family


@pytest.mark.parametrize(
    ("soc", "expected"),
    [
        ("Ascend310P1", "Ascend310P"),
        ("Ascend310P3", "Ascend310P"),
        ("Ascend310P7", "Ascend310P"),
        ("Ascend310B4", "Ascend310B"),
        ("Ascend910B1", "Ascend910B"),
        ("Ascend910B2C", "Ascend910B"),
        ("Ascend910B4-1", "Ascend910B"),
        ("Ascend910_9391", "Ascend910B"),  # Atlas A3 shares NpuArch 2201 with the 910B1..B4
        ("Ascend910_9362", "Ascend910B"),
        ("Ascend910A", "Ascend910"),
        ("Ascend910B", "Ascend910"),  # the chip named Ascend910B is the original 910 (NpuArch 1001)
        ("Ascend910PremiumA", "Ascend910"),
        ("ascend310p3", "Ascend310P"),
        ("Ascend310", None),
        ("Ascend950PR_9589", None),
        ("", None),
    ],
)
def test_each_chip_belongs_to_the_family_of_its_architecture(soc: str, expected: str | None) -> None:
    assert family(soc) == expected


@pytest.mark.parametrize(
    ("compiled_for", "host"),
    [
        ("Ascend310P3", "Ascend310P3"),
        ("Ascend310P1", "Ascend310P3"),
        ("Ascend910B3", "Ascend910B4"),
        ("Ascend910B2", "Ascend910_9392"),
        ("Ascend910ProB", "Ascend910A"),
        ("Ascend310", "Ascend310"),  # a chip not listed runs what was made for it
        ("ASCEND310P3", "Ascend310P3"),
    ],
)
def test_a_chip_runs_files_made_for_any_chip_of_its_family(compiled_for: str, host: str) -> None:
    assert compatible(compiled_for, host)


@pytest.mark.parametrize(
    ("compiled_for", "host"),
    [
        ("Ascend310P3", "Ascend910B3"),
        ("Ascend310B1", "Ascend310P3"),
        ("Ascend910B", "Ascend910B3"),  # the original 910 and the 910B series are two architectures
        ("Ascend910A", "Ascend910_9391"),
        ("Ascend310", "Ascend310P3"),  # a chip not listed: only itself
        ("Ascend310P3", "Ascend310"),
        ("Ascend310X", "Ascend310Y"),
    ],
)
def test_chips_of_two_architectures_or_unknown_ones_are_not_compatible(compiled_for: str, host: str) -> None:
    assert not compatible(compiled_for, host)
