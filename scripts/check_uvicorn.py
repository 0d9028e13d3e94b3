"""`make check-uvicorn`: the HTTP transport's tests against the oldest and the newest uvicorn pyproject.toml allows."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build"
# geserve/http/connections.py subclasses uvicorn's httptools protocol and relies on its internals, so the
# range in pyproject.toml is exactly what is tested here: its floor and the newest release below its bound.
# 0.53 is the floor because older releases do not send `connection: close` when a response ends the
# connection (as every response in progress at shutdown does), so clients reuse a closed connection.
OLDEST = "0.53.0"
NEWEST = "0.55.0"
# The connection guards (deadlines, cap, lingering closes, shutdown) and the in-place body reader.
TESTS = ("tests/e2e/test_connections.py", "tests/e2e/test_direct_bodies.py")


def installed_version() -> str:
    """The uvicorn of the environment this script runs in."""
    probe = [sys.executable, "-c", "import uvicorn; print(uvicorn.__version__)"]
    return subprocess.run(probe, cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def allowed_range() -> tuple[str, str]:
    """The floor and the exclusive upper bound of pyproject.toml's uvicorn requirement."""
    text = (ROOT / "pyproject.toml").read_text()
    found = re.search(r'"uvicorn>=([0-9.]+),<([0-9.]+)"', text)
    if found is None:
        raise SystemExit('pyproject.toml: expected a bounded requirement "uvicorn>=X,<Y"')
    return found.group(1), found.group(2)


def release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def check_range() -> None:
    """The versions tested here are the ends of the allowed range: a bound moved without testing fails."""
    floor, bound = allowed_range()
    newest = release(NEWEST)
    if release(floor) != release(OLDEST)[: len(release(floor))]:
        raise SystemExit(f"pyproject.toml allows uvicorn>={floor}, but the oldest tested is {OLDEST}")
    if release(bound) != (newest[0], newest[1] + 1):
        raise SystemExit(f"pyproject.toml allows uvicorn<{bound}, but the newest tested is {NEWEST}")


def install(version: str) -> Path:
    """uvicorn `version` alone in build/uvicorn-<version>, put first on PYTHONPATH for the test run. Its own
    dependencies (click, h11) and everything else come from the project's environment."""
    target = BUILD / f"uvicorn-{version}"
    if not (target / f"uvicorn-{version}.dist-info").is_dir():
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target)]
        subprocess.run([*command, f"uvicorn=={version}"], check=True)
    return target


def run_tests(version: str, target: Path) -> int:
    # The tests' geserve processes inherit the environment, so they import this uvicorn too.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(target), os.environ.get("PYTHONPATH"))))}
    probe = [sys.executable, "-c", "import uvicorn; print(uvicorn.__version__)"]
    seen = subprocess.run(probe, env=env, cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()
    if seen != version:
        raise SystemExit(f"expected uvicorn {version} on the path, got {seen}")
    print(f"uvicorn {version}:", flush=True)
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-n",
        str(len(TESTS)),
        "--dist",
        "loadfile",
    ]
    command += TESTS
    return subprocess.run(command, env=env, cwd=ROOT, check=False).returncode


def main() -> int:
    check_range()
    # After `make test` (as in CI) the environment's own uvicorn was just tested: only the other end is left.
    skip_installed = "--skip-installed" in sys.argv[1:]
    failed = []
    for version in (OLDEST, NEWEST):
        if skip_installed and version == installed_version():
            print(f"uvicorn {version}: the environment's own, tested by make test", flush=True)
            continue
        started = time.monotonic()
        status = run_tests(version, install(version))
        print(f"uvicorn {version}: exit {status} in {time.monotonic() - started:.0f} s", flush=True)
        if status != 0:
            failed.append(version)
    if failed:
        print(f"the HTTP transport fails with uvicorn {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
