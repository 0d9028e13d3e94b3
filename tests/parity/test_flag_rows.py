"""Each flag row holds: a refused flag stops the CLI naming it, an inapplicable one is warned naming it."""

from __future__ import annotations

import pytest

from geserve.cli import parse_settings
from tests.parity.proof import check_test_file
from tests.parity.table import Row, rows_of

# A value each refused flag refuses (the harmless ones, e.g. --grpc-use-ssl=false, are accepted).
REFUSED_VALUES = {
    "--rate-limit": "execution_count",
    "--rate-limit-resource": "R1:1:0",
    "--model-config-name": "h100",
    "--http-header-forward-pattern": "x-.*",
    "--grpc-header-forward-pattern": "x-.*",
}
IGNORED_VALUES = {"--backend-config": "python,shm-default-byte-size=1048576"}
REPOSITORY = ["--model-repository", "model_repository"]


def _id(row: Row) -> str:
    return row.key


@pytest.mark.parametrize("row", [row for row in rows_of("flag") if row.status == "refused"], ids=_id)
def test_refused_flag_stops_the_cli_naming_it(row: Row, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        parse_settings([*REPOSITORY, f"{row.key}={REFUSED_VALUES.get(row.key, 'true')}"])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert f"{row.key}=" in error and "is not supported" in error, error  # a refusal, not a bad value
    parse_settings(REPOSITORY)  # the same command line without it starts


@pytest.mark.parametrize("row", [row for row in rows_of("flag") if row.status == "not applicable"], ids=_id)
def test_inapplicable_flag_is_warned_naming_it(row: Row) -> None:
    settings = parse_settings([*REPOSITORY, f"{row.key}={IGNORED_VALUES.get(row.key, '1')}"])
    assert [warning for warning in settings.server.warnings if row.key in warning], settings.server.warnings


@pytest.mark.parametrize("row", rows_of("flag"), ids=_id)
def test_row_test_file_mentions_the_flag(row: Row) -> None:
    check_test_file(row)
