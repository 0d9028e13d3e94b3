"""`make check-oldest`: geserve beside the oldest protobuf, grpcio, numpy and tritonclient it supports, tested."""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / "build" / "oldest-venv"
# The floor of pyproject.toml's ranges, with the tritonclient of that time (2.50: protobuf<5, numpy<2).
OLDEST = ("protobuf==4.25.1", "grpcio==1.66.1", "numpy==1.26.4", "tritonclient[all]==2.50.0")
TEST_TOOLS = ("pytest>=8", "pytest-asyncio>=0.23", "pytest-timeout>=2.3", "hypothesis>=6.100")
# Both protocols through that tritonclient, and python models (whose configs go through protobuf's
# JSON form); the digits test needs scikit-learn, a test-only dependency not installed here.
TESTS = ("tests/e2e/test_grpc.py", "tests/e2e/test_http_infer.py", "tests/e2e/test_python_backend.py")
SKIP = "not digits"


def main() -> int:
    shutil.rmtree(VENV, ignore_errors=True)
    venv.create(VENV, with_pip=True)
    python = str(VENV / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "-q", "-e", f"{ROOT}[onnx]", *OLDEST, *TEST_TOOLS], check=True)
    versions = subprocess.run(
        [python, "-m", "pip", "list", "--format=freeze"], check=True, capture_output=True, text=True
    ).stdout
    wanted = {"protobuf", "grpcio", "numpy", "tritonclient"}
    print("\n".join(line for line in versions.splitlines() if line.split("==")[0].lower() in wanted))
    command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", SKIP, *TESTS]
    return subprocess.run(command, cwd=ROOT, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
