"""Write deploy/docker/constraints.txt: every runtime dependency of geserve[onnx], pinned as installed here."""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "deploy" / "docker" / "constraints.txt"
HEADER = """\
# Pinned versions for both images (Dockerfile.cpu and Dockerfile.ascend), so that a rebuild installs
# what was tested. Written by `python scripts/write_constraints.py` from an environment where
# `pip install -e '.[onnx]'` was run; every runtime dependency of geserve[onnx] is listed.
"""


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_closure(root: str = "geserve", extras: tuple[str, ...] = ("onnx",)) -> dict[str, str]:
    """Distribution key -> installed version for everything `root[extras]` needs at run time.

    Raises LookupError when `root`, or anything it needs here, is not installed in this interpreter: the pins
    would leave it out."""
    try:
        metadata.distribution(root)
    except metadata.PackageNotFoundError:
        # Before packaging is imported: an interpreter without geserve often lacks packaging too.
        raise LookupError(f"not installed in {sys.executable}: {root}") from None
    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    environment = default_environment()
    found: dict[str, str] = {}
    missing: list[str] = []
    pending: list[tuple[str, tuple[str, ...], str]] = [(root, extras, "")]
    while pending:
        name, wanted, needed_by = pending.pop()
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            missing.append(f"{name} (needed by {needed_by})" if needed_by else name)
            continue
        key = _key(name)
        if key in found and not wanted:
            continue
        found[key] = distribution.version
        for text in distribution.requires or []:
            requirement = Requirement(text)
            marker = requirement.marker
            if marker is None or any(marker.evaluate({**environment, "extra": e}) for e in (*wanted, "")):
                pending.append((requirement.name, tuple(requirement.extras), name))
    if missing:
        raise LookupError(f"not installed in {sys.executable}: {', '.join(sorted(set(missing)))}")
    found.pop(_key(root), None)
    return found


def main() -> int:
    try:
        pins = runtime_closure()
    except LookupError as error:
        # An empty or partial file would unpin the images; the environment that `make test` uses has everything.
        print(
            f"write_constraints: {error}; run it with the environment where `pip install -e '.[onnx]'` was run, "
            "e.g. `make .venv/.installed-run && .venv/bin/python scripts/write_constraints.py`",
            file=sys.stderr,
        )
        return 1
    TARGET.write_text(HEADER + "".join(f"{name}=={version}\n" for name, version in sorted(pins.items())))
    print(f"{len(pins)} pins written to {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
