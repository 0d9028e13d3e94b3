"""Python backend: `model.py` files written for Triton's python backend, run unchanged."""

from geserve.backends.python.backend import PythonBackend


def create_backend() -> PythonBackend:
    return PythonBackend()


__all__ = ["PythonBackend", "create_backend"]
