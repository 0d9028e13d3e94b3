"""geserve: a Triton-compatible (KServe v2) inference server in Python."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("geserve")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"
