"""A custom-op library for ONNX Runtime, built with the system C compiler: it registers no operator and appends a
line to a marker file each time a session's options register it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

_SOURCE = """
#include <stdio.h>
/* ONNX Runtime calls RegisterCustomOps(OrtSessionOptions*, const OrtApiBase*); NULL means success. */
void* RegisterCustomOps(void* options, const void* api) {
    FILE* marker = fopen(MARKER, "a");
    if (marker != NULL) {
        fputs("registered\\n", marker);
        fclose(marker);
    }
    return NULL;
}
"""


def build_op_library(folder: Path) -> tuple[Path, Path]:
    """(the library, its marker file); skips the test where no C compiler is installed."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build a custom-op library")
    folder.mkdir(parents=True, exist_ok=True)
    source, library, marker = folder / "ops.c", folder / "libgeserve_test_ops.so", folder / "registrations.txt"
    source.write_text(_SOURCE)
    subprocess.run(
        [compiler, "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(library), str(source)],
        check=True,
        capture_output=True,
    )
    return library, marker
