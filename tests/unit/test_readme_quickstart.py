"""The README's first steps hold in a clone: the `geserve inspect` example names a file the clone has and prints
what the command prints."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.support import ROOT

_CONSOLE = re.compile(r"```console\n\$ \.venv/bin/geserve inspect (\S+)\n(.*?)```", re.DOTALL)


def test_the_inspect_example_runs_on_a_tracked_file_and_shows_its_output() -> None:
    examples = _CONSOLE.findall((ROOT / "README.md").read_text())
    assert examples, "the README shows `.venv/bin/geserve inspect` on a file of this repository"
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
