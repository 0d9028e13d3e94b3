"""Model repositories in object storage: Triton's s3:// URL forms and credentials, mirrored into a local folder."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

# Schemes Triton reads a model repository from besides the local file system.
REMOTE_SCHEMES = ("s3://", "gs://", "as://")
UNSUPPORTED_SCHEMES = {
    "gs://": "Google Cloud Storage",
    "as://": "Azure Storage",
}
S3_EXTRA = "pip install 'geserve[s3]'"
# Triton's own pattern for an S3 URL that names its endpoint: s3://[http(s)://]host:port/bucket[/path].
_ENDPOINT_URL = re.compile(r"^s3://(http://|https://|)([0-9a-zA-Z\-.]+):([0-9]+)/([0-9a-z.\-]+)((/[^/]+)*)/?$")
_PLAIN_URL = re.compile(r"^s3://([0-9a-z.\-]+)((/[^/]+)*)/?$")
CREDENTIAL_PATH_VARIABLE = "TRITON_CLOUD_CREDENTIAL_PATH"
MOUNT_DIRECTORY_VARIABLE = "TRITON_AWS_MOUNT_DIRECTORY"
# A store that hangs answers every call with an error in bounded time: at most ATTEMPTS tries, each waiting at most
# CONNECT_TIMEOUT_S to connect and READ_TIMEOUT_S for each read (a stalled read, not a whole download), so about
# 2 x (5 + 10) s plus botocore's backoff (under 1 s before the second try) at worst.
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 10.0
ATTEMPTS = 2


class RemoteRepositoryError(FileNotFoundError):
    """A remote repository that cannot be read (its URL, its credentials, the store's answer): the message says
    which and why. A FileNotFoundError, as a missing local repository is."""


def is_remote(location: str) -> bool:
    return location.startswith(REMOTE_SCHEMES)


def refusal(location: str) -> str | None:
    """Why a repository location cannot be served, or None: the schemes geserve does not read, and s3:// without
    its optional dependency."""
    for scheme, store in UNSUPPORTED_SCHEMES.items():
        if location.startswith(scheme):
            return (
                f"model repository '{location}': {store} ({scheme}) repositories are not supported; "
                f"copy the repository to a local folder or to an S3-compatible store (s3://)"
            )
    if location.startswith("s3://"):
        try:
            import boto3  # noqa: F401
        except ImportError:
            return f"model repository '{location}': s3:// repositories need boto3: {S3_EXTRA}"
        try:
            parse_s3_url(location)
        except RemoteRepositoryError as error:
            return str(error)
    return None


@dataclass(frozen=True, slots=True)
class S3Location:
    """An s3:// repository: the endpoint (None: AWS's own), the bucket and the key prefix of its models."""

    url: str
    endpoint: str | None
    bucket: str
    prefix: str  # "" or "path/to/models/"


def parse_s3_url(url: str) -> S3Location:
    """Triton's two forms: s3://bucket/path, and s3://[http://|https://]host:port/bucket/path for a custom
    endpoint (MinIO, Ceph, OBS), which is http unless it says https."""
    endpoint_match = _ENDPOINT_URL.match(url)
    if endpoint_match is not None:
        scheme = endpoint_match.group(1) or "http://"
        endpoint = f"{scheme}{endpoint_match.group(2)}:{endpoint_match.group(3)}"
        return S3Location(url, endpoint, endpoint_match.group(4), _prefix(endpoint_match.group(5)))
    plain_match = _PLAIN_URL.match(url)
    if plain_match is not None and ":" not in url.removeprefix("s3://"):
        return S3Location(url, None, plain_match.group(1), _prefix(plain_match.group(2)))
    raise RemoteRepositoryError(
        f"model repository '{url}': not an S3 URL: expected s3://bucket/path or s3://[https://]host:port/bucket/path"
    )


def _prefix(path: str) -> str:
    path = path.strip("/")
    return f"{path}/" if path else ""


@dataclass(frozen=True, slots=True)
class S3Credential:
    """Triton's credential file entry for S3; empty values are left to boto3's own chain (the AWS_* variables,
    ~/.aws)."""

    key_id: str = ""
    secret_key: str = ""
    region: str = ""
    session_token: str = ""
    profile: str = ""


def credential_for(url: str, environ: Mapping[str, str] | None = None) -> S3Credential | None:
    """The credential TRITON_CLOUD_CREDENTIAL_PATH's file gives `url` (the entry with the longest key that
    prefixes it, "" matching every URL), or None without the variable: then boto3 reads the environment."""
    environ = os.environ if environ is None else environ
    path = environ.get(CREDENTIAL_PATH_VARIABLE)
    if not path:
        return None
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise RemoteRepositoryError(
            f"cannot read the cloud credential file '{path}' ({CREDENTIAL_PATH_VARIABLE}): {error}"
        ) from None
    entries = document.get("s3", {}) if isinstance(document, dict) else None
    if not isinstance(entries, dict):
        raise RemoteRepositoryError(f"cloud credential file '{path}': its \"s3\" member must be an object")
    matching = [key for key in entries if isinstance(key, str) and url.startswith(key)]
    if not matching:
        return None
    entry = entries[max(matching, key=len)]
    if not isinstance(entry, dict) or not all(isinstance(value, str) for value in entry.values()):
        raise RemoteRepositoryError(
            f"cloud credential file '{path}': the S3 entry for '{url}' must map names to strings"
        )
    known = {name: entry.get(name, "") for name in S3Credential.__dataclass_fields__}
    return S3Credential(**known)


def _client(location: S3Location, credential: S3Credential | None) -> Any:
    import boto3
    from botocore.config import Config

    credential = credential or S3Credential()
    session = boto3.session.Session(
        aws_access_key_id=credential.key_id or None,
        aws_secret_access_key=credential.secret_key or None,
        aws_session_token=credential.session_token or None,
        region_name=credential.region or None,
        profile_name=credential.profile or None,
    )
    config = Config(
        connect_timeout=CONNECT_TIMEOUT_S,
        read_timeout=READ_TIMEOUT_S,
        retries={"total_max_attempts": ATTEMPTS, "mode": "standard"},
    )
    return session.client("s3", endpoint_url=location.endpoint, config=config)


def _transfer_config() -> Any:
    """Downloads retry a body that stalls as often as a call is tried, not s3transfer's own 5 times."""
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(num_download_attempts=ATTEMPTS)


class S3Mirror:
    """A local copy of an s3:// repository. Every model folder of the bucket exists locally (so the repository
    index lists it); a model's files are downloaded when `sync` names it, and only those whose ETag changed."""

    def __init__(self, url: str, local: Path) -> None:
        self.location = parse_s3_url(url)
        self.local = local
        self._etags: dict[str, str] = {}  # relative path -> ETag of the object its local file was downloaded from
        self._client: Any = None
        self._client_credential: S3Credential | None = None  # the credential `_client` was made with

    def sync(self, models: Iterable[str] | None = None) -> None:
        """List the bucket, mirror its model folders, and bring the files of `models` (every model with None) up to
        date: new and changed objects downloaded, removed ones deleted. Blocking: call it off the event loop."""
        try:
            self._sync(None if models is None else set(models))
        except RemoteRepositoryError:
            raise
        except Exception as error:  # botocore's errors: credentials, endpoint, bucket, permissions
            raise RemoteRepositoryError(f"failed to read model repository '{self.location.url}': {error}") from None

    def _sync(self, models: set[str] | None) -> None:
        client = self._client_for(credential_for(self.location.url))
        objects = self._list(client)
        folders = {path.split("/", 1)[0] for path in objects if "/" in path}
        self.local.mkdir(parents=True, exist_ok=True)
        for entry in self.local.iterdir():
            if entry.name not in folders:
                self._forget(entry.name)
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        for folder in folders:
            (self.local / folder).mkdir(exist_ok=True)
        for folder in sorted(folders if models is None else folders & models):
            self._sync_model(
                client, folder, {path: etag for path, etag in objects.items() if path.startswith(f"{folder}/")}
            )

    def _client_for(self, credential: S3Credential | None) -> Any:
        """One client for every sync (boto3's clients are thread-safe and keep their connections open), made again
        only when the credential file gives another credential: it is read on each sync, so a new key takes."""
        if self._client is None or credential != self._client_credential:
            self._client = _client(self.location, credential)
            self._client_credential = credential
        return self._client

    def _list(self, client: Any) -> dict[str, str]:
        """Relative path -> ETag of every object under the prefix; folder markers ("a/b/") as "" ETags."""
        objects: dict[str, str] = {}
        pages = client.get_paginator("list_objects_v2").paginate(
            Bucket=self.location.bucket, Prefix=self.location.prefix
        )
        for page in pages:
            for item in page.get("Contents", ()):
                relative = item["Key"][len(self.location.prefix) :]
                if _safe(relative):
                    objects[relative] = "" if relative.endswith("/") else str(item.get("ETag", ""))
        return objects

    def _sync_model(self, client: Any, folder: str, objects: Mapping[str, str]) -> None:
        root = self.local / folder
        for relative, etag in objects.items():
            target = self.local / relative
            if relative.endswith("/"):
                target.mkdir(parents=True, exist_ok=True)
                continue
            if self._etags.get(relative) == etag and target.is_file():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{target.name}.partial")
            client.download_file(
                self.location.bucket, self.location.prefix + relative, str(partial), Config=_transfer_config()
            )
            os.replace(partial, target)  # a poll never sees half a file
            self._etags[relative] = etag
        files = {self.local / relative for relative in objects if not relative.endswith("/")}
        markers = {self.local / relative.rstrip("/") for relative in objects if relative.endswith("/")}
        for path in sorted(root.rglob("*"), reverse=True):  # deepest first, so emptied folders go too
            if "__pycache__" in path.parts or path in files or path in markers:
                continue
            if path.is_dir():
                if not any(path.iterdir()):  # an empty version folder left behind would read as a version
                    path.rmdir()
            else:
                path.unlink(missing_ok=True)
                self._etags.pop(path.relative_to(self.local).as_posix(), None)

    def _forget(self, folder: str) -> None:
        for relative in [relative for relative in self._etags if relative.startswith(f"{folder}/")]:
            del self._etags[relative]


def _safe(relative: str) -> bool:
    """An object key the mirror may write: no empty, "." or ".." parts, which could leave the mirror folder."""
    parts = PurePosixPath(relative).parts
    return bool(parts) and not relative.startswith("/") and all(part not in ("", ".", "..") for part in parts)


def mount_root(environ: Mapping[str, str] | None = None) -> Path | None:
    """Where Triton's TRITON_AWS_MOUNT_DIRECTORY puts the local copy, when set (it must exist)."""
    environ = os.environ if environ is None else environ
    value = environ.get(MOUNT_DIRECTORY_VARIABLE)
    if not value:
        return None
    root = Path(value)
    if not root.is_dir():
        raise RemoteRepositoryError(f"{MOUNT_DIRECTORY_VARIABLE} '{value}' is not an existing folder")
    return root
