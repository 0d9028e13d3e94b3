"""Offline tools that need no NPU, no pyACL and no running server: `geserve inspect` and `geserve check`."""
