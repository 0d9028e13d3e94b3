"""moto's S3 server on a loopback port, checking every request's signature, for the object storage runs."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.support import free_port

REGION = "us-east-1"
# moto checks signatures once this many requests have run: those that make the test user and its key.
UNSIGNED_REQUESTS = 3


class S3Server:
    """moto's S3 server as its own process, a user with a valid key (`credentials`), and a boto3 client of it."""

    def __init__(self, log: Path) -> None:
        import boto3  # the s3 extra: a test module without it skips before it gets here

        self.port = free_port()
        self._log = log.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(UNSIGNED_REQUESTS)},
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=2):  # a request would count
                    break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the S3 server did not start:\n{log.read_text()}") from None
                time.sleep(0.2)
        endpoint = f"http://127.0.0.1:{self.port}"
        iam = boto3.client(
            "iam", endpoint_url=endpoint, region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x"
        )
        iam.create_user(UserName="geserve")
        policy = '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}'
        iam.put_user_policy(UserName="geserve", PolicyName="all", PolicyDocument=policy)
        key = iam.create_access_key(UserName="geserve")["AccessKey"]
        self.key_id, self.secret_key = key["AccessKeyId"], key["SecretAccessKey"]
        self.credentials = {
            "AWS_ACCESS_KEY_ID": self.key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": REGION,
        }
        self.client: Any = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=self.key_id,
            aws_secret_access_key=self.secret_key,
            region_name=REGION,
        )

    def url(self, bucket: str, prefix: str) -> str:
        return f"s3://127.0.0.1:{self.port}/{bucket}/{prefix}"

    def upload(self, folder: Path, bucket: str, prefix: str) -> None:
        """Every file under `folder` as an object under `prefix`/<folder name>/."""
        base = f"{prefix}/{folder.name}" if prefix else folder.name
        for path in sorted(folder.rglob("*")):
            key = f"{base}/{path.relative_to(folder).as_posix()}"
            if path.is_file():
                self.client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())
            elif not any(path.iterdir()):  # an empty version folder, as S3 consoles make them
                self.client.put_object(Bucket=bucket, Key=f"{key}/")

    def delete_prefix(self, bucket: str, prefix: str) -> None:
        listed = self.client.list_objects_v2(Bucket=bucket, Prefix=prefix)
        for item in listed.get("Contents", ()):
            self.client.delete_object(Bucket=bucket, Key=item["Key"])

    @contextlib.contextmanager
    def hung(self) -> Iterator[None]:
        """The store hangs: the process is stopped, so connections are accepted (by the kernel) and requests sent,
        and nothing answers, until it continues at the end."""
        os.kill(self.process.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)
        self._log.close()
