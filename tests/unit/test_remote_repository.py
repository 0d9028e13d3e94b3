"""s3:// URLs and Triton's cloud credential file as Triton reads them; the mirror's one client and its timeouts."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from geserve.repository import remote
from geserve.repository.remote import (
    CREDENTIAL_PATH_VARIABLE,
    RemoteRepositoryError,
    S3Credential,
    S3Location,
    S3Mirror,
    credential_for,
    is_remote,
    parse_s3_url,
    refusal,
)
from tests.fakes.object_store import StandInStore


@pytest.mark.parametrize(
    ("url", "endpoint", "bucket", "prefix"),
    [
        ("s3://bucket", None, "bucket", ""),
        ("s3://bucket/", None, "bucket", ""),
        ("s3://my-bucket/path/to/models", None, "my-bucket", "path/to/models/"),
        ("s3://my.bucket/models/", None, "my.bucket", "models/"),
        ("s3://minio.local:9000/bucket/models", "http://minio.local:9000", "bucket", "models/"),
        ("s3://http://10.0.0.5:9000/bucket/models", "http://10.0.0.5:9000", "bucket", "models/"),
        ("s3://https://obs.example.com:443/bucket/a/b", "https://obs.example.com:443", "bucket", "a/b/"),
        ("s3://127.0.0.1:9000/bucket", "http://127.0.0.1:9000", "bucket", ""),
    ],
)
def test_s3_urls_in_tritons_forms(url: str, endpoint: str | None, bucket: str, prefix: str) -> None:
    location = parse_s3_url(url)
    assert (location.endpoint, location.bucket, location.prefix) == (endpoint, bucket, prefix)


@pytest.mark.parametrize("url", ["s3://", "s3://Upper/models", "s3://host:port/bucket", "s3://host:9000", "s3://a//b"])
def test_malformed_s3_urls_are_refused(url: str) -> None:
    with pytest.raises(RemoteRepositoryError, match="not an S3 URL"):
        parse_s3_url(url)


def test_remote_locations_and_what_is_refused() -> None:
    assert is_remote("s3://bucket/models") and is_remote("gs://b/m") and is_remote("as://a/c/m")
    assert not is_remote("/models") and not is_remote("s3:/bucket")  # a local folder whose name starts so
    assert refusal("/models") is None
    assert refusal("s3://bucket/models") is None
    assert "Google Cloud Storage (gs://) repositories are not supported" in str(refusal("gs://b/m"))
    assert "Azure Storage (as://) repositories are not supported" in str(refusal("as://a/c/m"))


def test_the_credential_file_entry_with_the_longest_matching_key_wins(tmp_path: Path) -> None:
    path = tmp_path / "cloud_credential.json"
    default = {"key_id": "A", "secret_key": "a", "region": "r1", "session_token": "", "profile": ""}
    specific = {"key_id": "B", "secret_key": "b", "region": "r2", "session_token": "t", "profile": "p"}
    path.write_text(json.dumps({"gs": {"": "x"}, "s3": {"": default, "s3://bucket-2": specific}}))
    environ = {"TRITON_CLOUD_CREDENTIAL_PATH": str(path)}
    assert credential_for("s3://bucket-1/models", environ) == S3Credential("A", "a", "r1")
    assert credential_for("s3://bucket-2/models", environ) == S3Credential("B", "b", "r2", "t", "p")
    assert credential_for("s3://bucket-1/models", {}) is None  # no file: boto3's own chain (AWS_* variables)


def test_a_credential_file_without_a_match_leaves_the_environment_to_boto3(tmp_path: Path) -> None:
    path = tmp_path / "cloud_credential.json"
    path.write_text(json.dumps({"s3": {"s3://other": {"key_id": "B"}}}))
    assert credential_for("s3://bucket/models", {"TRITON_CLOUD_CREDENTIAL_PATH": str(path)}) is None


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "cannot read the cloud credential file"),
        ('{"s3": []}', 'its "s3" member must be an object'),
        ('{"s3": {"": {"key_id": 5}}}', "must map names to strings"),
    ],
)
def test_a_bad_credential_file_is_a_clear_error(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "cloud_credential.json"
    path.write_text(content)
    with pytest.raises(RemoteRepositoryError, match=message):
        credential_for("s3://bucket/models", {"TRITON_CLOUD_CREDENTIAL_PATH": str(path)})


def test_one_client_serves_every_sync_until_the_credential_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[S3Credential | None] = []

    def make(location: S3Location, credential: S3Credential | None) -> StandInStore:
        made.append(credential)
        return StandInStore({"repo/a/1/model.onnx": b"onnx", "repo/b/config.pbtxt": b""})

    monkeypatch.setattr(remote, "_client", make)
    monkeypatch.delenv(CREDENTIAL_PATH_VARIABLE, raising=False)
    mirror = S3Mirror("s3://127.0.0.1:9000/bucket/repo", tmp_path / "copy")
    mirror.sync()
    mirror.sync(["a"])
    mirror.sync(())
    assert made == [None]
    assert (tmp_path / "copy" / "a" / "1" / "model.onnx").read_bytes() == b"onnx"
    # The credential file is read on each sync: a new key gets a client of its own, once.
    path = tmp_path / "cloud_credential.json"
    path.write_text(json.dumps({"s3": {"": {"key_id": "B", "secret_key": "b"}}}))
    monkeypatch.setenv(CREDENTIAL_PATH_VARIABLE, str(path))
    mirror.sync()
    mirror.sync()
    assert made == [None, S3Credential("B", "b")]


def test_calls_to_the_store_are_bounded_in_time() -> None:
    client = remote._client(parse_s3_url("s3://127.0.0.1:9000/bucket/repo"), S3Credential("A", "a", "us-east-1"))
    config = client.meta.config
    assert (config.connect_timeout, config.read_timeout) == (5.0, 10.0)
    assert config.retries == {"total_max_attempts": 2, "mode": "standard"}
    assert remote._transfer_config().num_download_attempts == 2


def test_a_store_that_never_answers_fails_the_sync_within_its_timeouts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Connections are accepted (the kernel's backlog) and never answered: a hung store.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    monkeypatch.setattr(remote, "CONNECT_TIMEOUT_S", 0.5)
    monkeypatch.setattr(remote, "READ_TIMEOUT_S", 0.5)
    monkeypatch.delenv(CREDENTIAL_PATH_VARIABLE, raising=False)
    for name, value in {
        "AWS_ACCESS_KEY_ID": "A",
        "AWS_SECRET_ACCESS_KEY": "a",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    url = f"s3://127.0.0.1:{listener.getsockname()[1]}/bucket/repo"
    mirror = S3Mirror(url, tmp_path / "copy")
    failures: list[BaseException] = []
    started = time.monotonic()
    worker = threading.Thread(target=lambda: _catch(mirror.sync, failures), daemon=True)
    try:
        worker.start()
        worker.join(10)
        elapsed = time.monotonic() - started
    finally:
        listener.close()
    assert not worker.is_alive(), "the sync still waits on the store"
    assert elapsed < 5  # 2 tries of 0.5 s each, and the backoff between them
    assert len(failures) == 1 and isinstance(failures[0], RemoteRepositoryError)
    assert f"failed to read model repository '{url}': Read timeout on endpoint URL" in str(failures[0])


def _catch(work: Callable[[], object], failures: list[BaseException]) -> None:
    try:
        work()
    except BaseException as error:  # the test reads it
        failures.append(error)
