"""A stand-in boto3 S3 client: S3Mirror's calls answered from a dict, failed, or hung as a store that never answers."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

# How long a hung call waits for its release before failing anyway: a test that fails never hangs the suite.
HANG_LIMIT_S = 30.0


class StandInStore:
    """Objects (key -> bytes) under one bucket. While `hanging`, each call blocks until `release` is set and then
    fails as a read timeout does; with `failure` set, each call fails at once with that message. `hung` counts the
    calls that hung, `threads` names the threads calls ran on."""

    def __init__(self, objects: dict[str, bytes] | None = None) -> None:
        self.objects = dict(objects or {})
        self.hanging = False
        self.failure: str | None = None
        self.release = threading.Event()
        self.hung = 0
        self.threads: set[str] = set()
        self._lock = threading.Lock()

    def get_paginator(self, operation: str) -> StandInStore:
        assert operation == "list_objects_v2", operation
        return self

    def paginate(self, Bucket: str, Prefix: str) -> list[dict[str, Any]]:  # noqa: N803 (boto3's names)
        self._call()
        keys = sorted(key for key in self.objects if key.startswith(Prefix))
        return [{"Contents": [{"Key": key, "ETag": f'"{hash(self.objects[key])}"'} for key in keys]}]

    def download_file(self, bucket: str, key: str, filename: str, **_: Any) -> None:
        self._call()
        Path(filename).write_bytes(self.objects[key])

    def _call(self) -> None:
        with self._lock:
            self.threads.add(threading.current_thread().name)
        if self.failure is not None:
            raise RuntimeError(self.failure)
        if self.hanging:
            with self._lock:
                self.hung += 1
            self.release.wait(HANG_LIMIT_S)
            raise TimeoutError('Read timeout on endpoint URL: "http://127.0.0.1:9000/bucket"')
