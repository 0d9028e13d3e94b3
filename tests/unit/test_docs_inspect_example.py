"""The docs' `geserve inspect` example holds in a clone: it names a file the clone has and shows what the command
prints."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.support import ROOT

_CONSOLE = re.compile(r"```console\n\$ \.venv/bin/geserve inspect (\S+)\n(.*?)```", re.DOTALL)


def test_the_inspect_example_runs_on_a_tracked_file_and_shows_its_output() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    examples = [example for page in pages for example in _CONSOLE.findall(page.read_text())]
    assert _CONSOLE.findall((ROOT / "docs" / "ascend.md").read_text()), "docs/ascend.md shows no `geserve inspect`"
    for path, shown in examples:
        assert (ROOT / path).is_file(), f"{path} does not exist"
        if (ROOT / ".git").exists():  # a clone, not an unpacked sdist: the file must be committed, not just here
            tracked = subprocess.run(
                ["git", "ls-files", "--error-unmatch", path], cwd=ROOT, capture_output=True, check=False
            )
            assert tracked.returncode == 0, f"{path} is not in the repository"
        result = subprocess.run(
            [sys.executable, "-m", "geserve", "inspect", path], cwd=ROOT, capture_output=True, text=True, check=True
        )
        lines = shown.rstrip("\n").split("\n")
        assert lines[-1] == "...", "the example ends with `...` where it leaves the rest out"
        assert result.stdout.split("\n")[: len(lines) - 1] == lines[:-1]
