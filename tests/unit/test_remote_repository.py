"""s3:// repository URLs and Triton's cloud credential file, read as Triton reads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from geserve.repository.remote import (
    RemoteRepositoryError,
    S3Credential,
    credential_for,
    is_remote,
    parse_s3_url,
    refusal,
)


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
