"""Write deploy/docker/constraints.txt: every runtime dependency of geserve[onnx], pinned as installed here."""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

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
    """Distribution key -> installed version for everything `root[extras]` needs at run time."""
    environment = default_environment()
    found: dict[str, str] = {}
    pending = [(root, extras)]
    while pending:
        name, wanted = pending.pop()
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        key = _key(name)
        if key in found and not wanted:
            continue
        found[key] = distribution.version
        for text in distribution.requires or []:
            requirement = Requirement(text)
            marker = requirement.marker
            if marker is None or any(marker.evaluate({**environment, "extra": e}) for e in (*wanted, "")):
                pending.append((requirement.name, tuple(requirement.extras)))
    found.pop(_key(root), None)
    return found


def main() -> int:
    pins = runtime_closure()
    TARGET.write_text(HEADER + "".join(f"{name}=={version}\n" for name, version in sorted(pins.items())))
    print(f"{len(pins)} pins written to {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
