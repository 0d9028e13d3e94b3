"""The Makefile's venv step: makes .venv, and makes it again when the wrong Python made it.

Standard library only, and nothing newer than Python 3.6, because it runs on whatever `PYTHON` names (default
`python3`), which may be older than geserve allows; saying so is part of its job.

- No venv yet: made with PYTHON, when PYTHON satisfies pyproject.toml's requires-python; refused otherwise.
- A venv whose interpreter no longer runs (its Python was uninstalled), or older than requires-python: made again.
- PYTHON set on make's command line or in the environment (--python-chosen) and the venv made by another
  major.minor: made again with PYTHON, so `make run PYTHON=python3.12` gets a 3.12 venv.
- Otherwise the venv is kept, whatever python3 is now: a venv made with `PYTHON=python3.11` keeps serving a plain
  `make test` on a host whose python3 is 3.10.

The stamp (<venv>/.made) is rewritten only when the venv is made, so the install stamps that depend on it are
redone then and only then.
"""

import argparse
import operator
import os
import re
import shutil
import subprocess
import sys
from typing import List, NamedTuple, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAMP = ".made"
_REQUIRES_PYTHON = re.compile(r'^requires-python\s*=\s*"([^"]*)"\s*$', re.MULTILINE)
_COMPARE = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}
_CLAUSE = re.compile(r"^(>=|<=|>|<)\s*(\d+(?:\.\d+){0,2})$")

Version = Tuple[int, int, int]


class Decision(NamedTuple):
    """What to do with the venv: "keep", "make" or "refuse"; `reason` is what the user is told (empty: nothing)."""

    action: str
    reason: str = ""


def parse_requires_python(text: str) -> Tuple[str, List[Tuple[str, Version]]]:
    """pyproject.toml's requires-python and its clauses; only >=, >, <= and < (all geserve has needed) are read."""
    match = _REQUIRES_PYTHON.search(text)
    if match is None:
        raise ValueError("pyproject.toml has no requires-python")
    clauses = []
    for part in match.group(1).split(","):
        clause = _CLAUSE.match(part.strip())
        if clause is None:
            raise ValueError(
                "requires-python = " + repr(match.group(1)) + ": scripts/ensure_venv.py reads only >=, >, <= and < "
                "clauses of up to three numbers, not " + repr(part.strip())
            )
        numbers = [int(number) for number in clause.group(2).split(".")] + [0, 0]
        clauses.append((clause.group(1), (numbers[0], numbers[1], numbers[2])))
    return match.group(1), clauses


def satisfies(version: Version, clauses: Sequence[Tuple[str, Version]]) -> bool:
    return all(_COMPARE[sign](version, bound) for sign, bound in clauses)


def _text(version: Version) -> str:
    return "{}.{}.{}".format(*version)


def decide(
    *,
    requires: str,
    clauses: Sequence[Tuple[str, Version]],
    python: Version,
    python_name: str,
    python_chosen: bool,
    venv: str,
    venv_python: Optional[Version],
    venv_exists: bool,
) -> Decision:
    """`venv_python` is None when there is no venv, or when its interpreter does not run (`venv_exists` tells which)."""
    chosen = "PYTHON=" + python_name + " (Python " + _text(python) + ")"
    if venv_python is not None and satisfies(venv_python, clauses):
        if not python_chosen or venv_python[:2] == python[:2]:
            return Decision("keep")
        why = venv + " was made by Python " + _text(venv_python) + ", and " + chosen + " is another"
    elif venv_python is not None:
        why = venv + " was made by Python " + _text(venv_python) + ", and geserve needs Python " + requires
    elif venv_exists:
        why = venv + "/bin/python does not run (its Python was removed or moved)"
    else:
        why = ""
    if not satisfies(python, clauses):
        problem = "geserve needs Python " + requires + ", and " + chosen + " is not"
        if why and not python_chosen:  # the default python3 was asked only because the venv must be made again
            problem = why + "; " + problem
        return Decision("refuse", problem + ": name a Python " + requires + ", e.g. `make run PYTHON=python3.11`")
    if not why:
        return Decision("make", "making " + venv + " with " + chosen)
    return Decision("make", why + ": making it again with " + chosen)


def venv_python_version(venv: str) -> Optional[Version]:
    """The version of the venv's interpreter, None when there is none or it does not run."""
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        return None
    try:
        probe = subprocess.run(
            [python, "-c", "import sys; print('.'.join(map(str, sys.version_info[:3])))"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            universal_newlines=True,  # noqa: UP021 (text= is 3.7+)
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    parts = probe.stdout.strip().split(".")
    if probe.returncode != 0 or len(parts) != 3 or not all(part.isdigit() for part in parts):
        return None
    return (int(parts[0]), int(parts[1]), int(parts[2]))


def make_venv(venv: str) -> None:
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([os.path.join(venv, "bin", "python"), "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
    with open(os.path.join(venv, STAMP), "w") as stream:
        stream.write(sys.version.split()[0] + "\n")


def adopt(venv: str) -> None:
    """A venv made before this stamp existed: stamped as old as the venv, so nothing in it is installed again."""
    stamp = os.path.join(venv, STAMP)
    if os.path.exists(stamp):
        return
    config = os.path.join(venv, "pyvenv.cfg")
    made = (
        os.stat(config).st_mtime if os.path.exists(config) else os.lstat(os.path.join(venv, "bin", "python")).st_mtime
    )
    with open(stamp, "w") as stream:
        stream.write("adopted\n")
    os.utime(stamp, (made, made))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", default=".venv")
    parser.add_argument("--pyproject", default=os.path.join(ROOT, "pyproject.toml"))
    parser.add_argument("--python-name", default="python3", help="how the Makefile's PYTHON names this interpreter")
    parser.add_argument(
        "--python-chosen", action="store_true", help="PYTHON was set on make's command line or in the environment"
    )
    args = parser.parse_args(argv)
    with open(args.pyproject) as stream:
        text = stream.read()
    try:
        requires, clauses = parse_requires_python(text)
    except ValueError as error:
        print("ensure_venv: " + str(error), file=sys.stderr)
        return 1
    version = sys.version_info
    decision = decide(
        requires=requires,
        clauses=clauses,
        python=(version[0], version[1], version[2]),
        python_name=args.python_name,
        python_chosen=args.python_chosen,
        venv=args.venv,
        venv_python=venv_python_version(args.venv),
        venv_exists=os.path.isdir(args.venv),
    )
    if decision.action == "refuse":
        print("ensure_venv: " + decision.reason, file=sys.stderr)
        return 1
    if decision.action == "keep":
        adopt(args.venv)
        return 0
    print("ensure_venv: " + decision.reason)
    make_venv(args.venv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
