"""The "Triton compatibility" tables of docs/compatibility.md, parsed: the one list of rows the parity tests check."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE_NAME = "docs/compatibility.md"
PAGE = ROOT / PAGE_NAME
TITLE = "# Triton compatibility"
STATUSES = ("works", "refused", "not applicable")

# Each table's `##` heading starts with one of these; the kind says what its keys name.
KINDS = {
    "Model configuration": "config",
    "tritonserver flags": "flag",
    "Protocol extensions": "extension",
    "Python backend API": "pb_utils",
}

_CODE = re.compile(r"`([^`]+)`")


@dataclass(frozen=True, slots=True)
class Row:
    """One table row: what it is about, geserve's answer, why, and the test file that proves it."""

    kind: str
    key: str
    status: str
    reason: str
    test_file: str
    line: int

    @property
    def id(self) -> str:
        return f"{self.kind}:{self.key}"

    @property
    def where(self) -> str:
        """The row's place, for messages: the page and line."""
        return f"{PAGE_NAME} line {self.line}"


def _title_start(text: str) -> int:
    title = re.search(rf"^{re.escape(TITLE)}$", text, re.MULTILINE)
    if title is None:
        raise ValueError(f"no '{TITLE}' heading")
    return title.start()


def section_text(text: str) -> str:
    """The page from its "Triton compatibility" title up to the next first-level heading, if any."""
    start = _title_start(text)
    end = text.find("\n# ", start + len(TITLE))
    return text[start : end if end >= 0 else len(text)]


def parse_rows(text: str) -> list[Row]:
    """Every table row of the section, each with the kind its `##` heading names."""
    rows: list[Row] = []
    kind: str | None = None
    columns: list[str] = []
    first_line = text[: _title_start(text)].count("\n") + 1
    for offset, line in enumerate(section_text(text).splitlines()):
        if line.startswith("## "):
            title = line.removeprefix("## ")
            kind = next((value for prefix, value in KINDS.items() if title.startswith(prefix)), None)
            columns = []
            continue
        if kind is None or not line.startswith("|"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not columns:
            columns = [cell.lower() for cell in cells]
            continue
        if set("".join(cells)) <= set("-: "):
            continue
        cell = dict(zip(columns, cells, strict=True))
        key = _CODE.search(cells[0])
        test = _CODE.search(cell["proved by"])
        rows.append(
            Row(
                kind=kind,
                key=key.group(1) if key else cells[0],
                status=cell["status"],
                reason=cell["how or why"],
                test_file=test.group(1) if test else cell["proved by"],
                line=first_line + offset,
            )
        )
    return rows


@functools.cache
def compatibility_rows() -> tuple[Row, ...]:
    return tuple(parse_rows(PAGE.read_text(encoding="utf-8")))


def rows_of(kind: str) -> list[Row]:
    return [row for row in compatibility_rows() if row.kind == kind]
