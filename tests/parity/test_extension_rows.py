"""Each extension row's test file exists and names the extension; advertising is checked in test_coverage."""

from __future__ import annotations

import pytest

from geserve.core.shared_memory import CUDA_UNSUPPORTED
from tests.parity.proof import check_test_file
from tests.parity.table import Row, rows_of


@pytest.mark.parametrize("row", rows_of("extension"), ids=lambda row: row.key)
def test_row_test_file_mentions_the_extension(row: Row) -> None:
    check_test_file(row)


def test_cuda_shared_memory_row_quotes_the_refusal() -> None:
    (row,) = [row for row in rows_of("extension") if row.key == "cuda_shared_memory"]
    assert row.status == "refused"
    assert CUDA_UNSUPPORTED in row.reason
