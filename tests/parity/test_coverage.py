"""Every config field, flag, extension and pb_utils name has exactly one row, and every row names a real one."""

from __future__ import annotations

from collections import Counter

import pytest

from geserve.core.service import EXTENSIONS
from tests.parity import names
from tests.parity.table import STATUSES, compatibility_rows, rows_of


def _config_covered(path: str, keys: set[str]) -> bool:
    return (
        path in keys
        or any(key.endswith(".*") and (path + ".").startswith(key[:-1]) for key in keys)
        or any(key.endswith(".*") and path == key[:-2] for key in keys)
    )


def test_the_tables_are_found() -> None:
    kinds = Counter(row.kind for row in compatibility_rows())
    assert set(kinds) == {"config", "flag", "extension", "pb_utils"}, kinds


def test_no_key_has_two_rows() -> None:
    counts = Counter(row.id for row in compatibility_rows())
    assert [key for key, count in counts.items() if count > 1] == []


def test_every_config_field_has_a_row() -> None:
    keys = {row.key for row in rows_of("config")}
    missing = [path for path in sorted(names.config_paths()) if not _config_covered(path, keys)]
    assert missing == [], "ModelConfig fields without a row in docs/compatibility.md"


def test_every_flag_has_a_row() -> None:
    keys = {row.key.split("=", 1)[0] for row in rows_of("flag")}
    assert sorted(names.all_flags() - keys) == [], "flags without a row in docs/compatibility.md"


def test_every_extension_has_a_row() -> None:
    keys = {row.key for row in rows_of("extension")}
    assert sorted(names.all_extensions() - keys) == [], "extensions without a row in docs/compatibility.md"


def test_every_pb_utils_name_has_a_row() -> None:
    keys = {row.key for row in rows_of("pb_utils")}
    assert sorted(names.all_pb_utils() - keys) == [], "pb_utils names without a row in docs/compatibility.md"


@pytest.mark.parametrize("row", compatibility_rows(), ids=lambda row: row.id)
def test_row_names_something_that_exists(row) -> None:  # type: ignore[no-untyped-def]
    if row.kind == "config":
        paths = names.config_paths()
        key = row.key.removesuffix(".*")
        if "[" in key:
            field, _, map_key = key.partition("[")
            assert field in paths and names.is_map(paths[field]), f"'{field}' is not a map field"
            assert map_key.endswith("]") and len(map_key) > 1
        else:
            assert key in paths, f"ModelConfig has no field '{key}'"
    elif row.kind == "flag":
        assert row.key.split("=", 1)[0] in names.all_flags(), f"neither geserve nor tritonserver has {row.key}"
    elif row.kind == "extension":
        assert row.key in names.all_extensions()
    else:
        assert row.key in names.all_pb_utils(), f"neither geserve's nor Triton's pb_utils has {row.key}"


@pytest.mark.parametrize("row", compatibility_rows(), ids=lambda row: row.id)
def test_row_has_a_status_and_a_reason(row) -> None:  # type: ignore[no-untyped-def]
    assert row.status in STATUSES, f"{row.where}: status '{row.status}'"
    assert "no effect" not in f"{row.status} {row.reason}".lower(), f"{row.where} reads 'no effect'"
    assert len(row.reason) > 3, f"{row.where}: no reason"


@pytest.mark.parametrize("row", rows_of("extension"), ids=lambda row: row.key)
def test_extension_is_advertised_exactly_when_it_works(row) -> None:  # type: ignore[no-untyped-def]
    assert (row.key in EXTENSIONS) == (row.status == "works")
