"""The compatibility table parser: headings pick the kind, header names pick the columns, nothing else is a row."""

from __future__ import annotations

from tests.parity.table import parse_rows

TEXT = """<!-- a line before the title -->

# Triton compatibility

Prose with a | pipe that is not a table.

## Model configuration (`config.pbtxt`)

| field | status | how or why | proved by |
|---|---|---|---|
| `max_batch_size` | works | the batch dim | `tests/unit/test_config.py` |

## tritonserver flags

| flag | group | status | how or why | proved by |
|---|---|---|---|---|
| `--rate-limit` | rate limiter | refused | no rate limiter | `tests/parity/test_flag_rows.py` |

## Next section

| `ignored` | works | under a heading of no kind | `x` |

# Another page

## Python backend API

| name | status | how or why | proved by |
|---|---|---|---|
| `ignored` | works | outside the section | `x` |
"""


def test_rows_take_their_kind_and_columns() -> None:
    rows = parse_rows(TEXT)
    assert [(row.kind, row.key, row.status, row.reason, row.test_file) for row in rows] == [
        ("config", "max_batch_size", "works", "the batch dim", "tests/unit/test_config.py"),
        ("flag", "--rate-limit", "refused", "no rate limiter", "tests/parity/test_flag_rows.py"),
    ]
    assert TEXT.splitlines()[rows[0].line - 1].startswith("| `max_batch_size`")
