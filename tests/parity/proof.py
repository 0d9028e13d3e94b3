"""The cheap check every row gets: its test file exists and mentions what the row is about."""

from __future__ import annotations

from tests.parity.table import ROOT, Row


def mentioned_name(row: Row) -> str:
    """The word a row's test file must contain: a config field's last name (or map key), the flag, the
    extension, the pb_utils name's last part."""
    key = row.key.removesuffix(".*")
    if row.kind == "config":
        return key.split("[", 1)[1].rstrip("]") if "[" in key else key.rsplit(".", 1)[-1]
    if row.kind == "flag":
        return key.split("=", 1)[0]
    if row.kind == "pb_utils":
        return key.rsplit(".", 1)[-1]
    return key.split("(", 1)[-1].rstrip(")")  # model_repository(unload_dependents): the sub-extension


def check_test_file(row: Row) -> None:
    path = ROOT / row.test_file
    assert row.test_file.startswith("tests/"), f"{row.where}: '{row.test_file}' is not a test file"
    assert path.is_file(), f"{row.where}: {row.test_file} does not exist"
    if row.test_file.startswith("tests/parity/"):
        return  # the parity test parametrized by this row is the proof
    word = mentioned_name(row)
    assert word in path.read_text(encoding="utf-8"), f"{row.where}: {row.test_file} never mentions {word}"
