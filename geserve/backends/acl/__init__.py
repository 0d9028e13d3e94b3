"""Ascend backend: ATC-compiled `.om` models run through pyACL on one NPU per worker."""

from geserve.backends.acl.backend import AclBackend, create_backend

__all__ = ["AclBackend", "create_backend"]
