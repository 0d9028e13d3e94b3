"""Model repositories in S3-compatible object storage, served from a real S3 server (moto's, checking every
request's signature) on a loopback port."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.s3_server import REGION, S3Server
from tests.support import GeserveProcess, descendants, run_on_threads, write_identity_model

boto3 = pytest.importorskip("boto3")

pytestmark = [pytest.mark.e2e, pytest.mark.one_layout]

Launch = Callable[..., GeserveProcess]
WRONG_KEY = {
    "AWS_ACCESS_KEY_ID": "AKIAWRONGWRONGWRONG0",
    "AWS_SECRET_ACCESS_KEY": "wrong",
    "AWS_DEFAULT_REGION": REGION,
}


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = S3Server(tmp_path_factory.mktemp("s3") / "moto.log")
    yield server
    server.stop()


def _bucket(s3: S3Server, name: str, tmp_path: Path, *models: str) -> str:
    """A bucket whose prefix `repo` holds identity models named `models` (FP32 [-1], version 1)."""
    s3.client.create_bucket(Bucket=name)
    for model in models:
        s3.upload(write_identity_model(tmp_path / "source", model), name, "repo")
    return s3.url(name, "repo")


def _echo(url: str, model: str, values: list[float]) -> None:
    data = np.array([values], dtype=np.float32)
    with httpclient.InferenceServerClient(url) as client:
        tensor = httpclient.InferInput("INPUT0", list(data.shape), "FP32")
        tensor.set_data_from_numpy(data)
        np.testing.assert_array_equal(client.infer(model, [tensor]).as_numpy("OUTPUT0"), data)


def _echo_grpc(server: GeserveProcess, model: str, values: list[float]) -> None:
    data = np.array([values], dtype=np.float32)
    with grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}") as client:
        tensor = grpcclient.InferInput("INPUT0", list(data.shape), "FP32")
        tensor.set_data_from_numpy(data)
        np.testing.assert_array_equal(client.infer(model, [tensor]).as_numpy("OUTPUT0"), data)


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        time.sleep(0.2)


def test_a_repository_in_s3_serves_its_models_over_http_and_grpc(launch: Launch, s3: S3Server, tmp_path: Path) -> None:
    url = _bucket(s3, "startup", tmp_path, "echo", "other")
    server = launch(f"--model-repository={url}", env=s3.credentials).wait_live()
    _echo(server.url, "echo", [1.0, 2.0, 3.0])
    _echo(server.url, "other", [4.0])
    _echo_grpc(server, "echo", [5.0, 6.0])
    with httpclient.InferenceServerClient(server.url) as client:
        index = {(entry["name"], entry.get("state")) for entry in client.get_model_repository_index()}
    assert index == {("echo", "READY"), ("other", "READY")}


def test_a_repository_at_the_top_of_a_bucket_and_several_repositories(
    launch: Launch, s3: S3Server, tmp_path: Path
) -> None:
    s3.client.create_bucket(Bucket="top")
    s3.upload(write_identity_model(tmp_path / "source", "at_top"), "top", "")
    (tmp_path / "local").mkdir()
    write_identity_model(tmp_path / "local", "local_echo")
    remote = f"s3://127.0.0.1:{s3.port}/top"
    server = launch(
        f"--model-repository={remote}", f"--model-repository={tmp_path / 'local'}", env=s3.credentials
    ).wait_live()
    _echo(server.url, "at_top", [1.0])
    _echo(server.url, "local_echo", [2.0])


def _launch_with_mount(
    launch: Launch, s3: S3Server, tmp_path: Path, url: str, *flags: str
) -> tuple[GeserveProcess, Path]:
    """A server of the bucket prefix `url` that keeps what it downloads in tmp_path/mount (Triton's
    TRITON_AWS_MOUNT_DIRECTORY); and that folder."""
    mount = tmp_path / "mount"
    mount.mkdir()
    env = {**s3.credentials, "TRITON_AWS_MOUNT_DIRECTORY": str(mount)}
    return launch(f"--model-repository={url}", *flags, env=env).wait_live(), mount


def test_polling_sees_a_model_appear_change_and_leave(launch: Launch, s3: S3Server, tmp_path: Path) -> None:
    url = _bucket(s3, "polled", tmp_path, "echo")
    server, mount = _launch_with_mount(
        launch, s3, tmp_path, url, "--model-control-mode=poll", "--repository-poll-secs=1"
    )
    _echo(server.url, "echo", [1.0])
    copied = next(mount.iterdir()) / "echo" / "config.pbtxt"
    copied_ns = copied.stat().st_mtime_ns
    with httpclient.InferenceServerClient(server.url) as client:
        s3.upload(write_identity_model(tmp_path / "later", "added"), "polled", "repo")
        _wait_for(lambda: client.is_model_ready("added"))
        _echo(server.url, "added", [3.0])
        assert copied.stat().st_mtime_ns == copied_ns  # polls download only what changed

        # A new version folder (and a config serving every version) changes the model: it is reloaded.
        changed = write_identity_model(tmp_path / "changed", "echo", versions=(1, 2))
        config = (changed / "config.pbtxt").read_text() + "version_policy: { all: {} }\n"
        (changed / "config.pbtxt").write_text(config)
        s3.upload(changed, "polled", "repo")
        _wait_for(lambda: client.is_model_ready("echo", "2"))
        assert client.is_model_ready("echo", "1")

        s3.delete_prefix("polled", "repo/added/")
        _wait_for(lambda: not client.is_model_ready("added"))
        _echo(server.url, "echo", [4.0])


def test_explicit_load_downloads_only_the_model_it_names(launch: Launch, s3: S3Server, tmp_path: Path) -> None:
    url = _bucket(s3, "explicit", tmp_path, "echo", "idle")
    server, mount = _launch_with_mount(launch, s3, tmp_path, url, "--model-control-mode=explicit", "--load-model=echo")
    copies = next(mount.iterdir())
    assert (copies / "echo" / "config.pbtxt").is_file()
    assert not (copies / "idle" / "config.pbtxt").exists()  # listed, not downloaded: nobody loaded it
    with httpclient.InferenceServerClient(server.url) as client:
        names = {entry["name"] for entry in client.get_model_repository_index()}
        assert names == {"echo", "idle"}
        s3.upload(write_identity_model(tmp_path / "later", "uploaded"), "explicit", "repo")
        client.load_model("uploaded")
        _echo(server.url, "uploaded", [7.0])
        assert not (copies / "idle" / "config.pbtxt").exists()

        # A config override with file: contents works as for a local repository.
        override = {"name": "inline", "backend": "identity", "max_batch_size": 8}
        override |= {"input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}]}
        override |= {"output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}]}
        client.load_model("inline", config=json.dumps(override), files={"file:1/placeholder": b""})
        _echo(server.url, "inline", [8.0])

        with pytest.raises(InferenceServerException) as missing:
            client.load_model("missing")
        assert "failed to load 'missing', failed to poll from model repository" in str(missing.value)
        _echo(server.url, "echo", [9.0])


def test_a_wrong_key_stops_the_start_naming_the_url(launch: Launch, s3: S3Server, tmp_path: Path) -> None:
    url = _bucket(s3, "wrong-key", tmp_path, "echo")
    server = launch(f"--model-repository={url}", env=WRONG_KEY)
    assert server.wait_exit() != 0
    assert f"failed to read model repository '{url}'" in server.log()
    assert "InvalidAccessKeyId" in server.log()


def test_the_credential_file_wins_over_the_environment(launch: Launch, s3: S3Server, tmp_path: Path) -> None:
    url = _bucket(s3, "file-wins", tmp_path, "echo")
    credentials = tmp_path / "cloud_credential.json"
    entry = {"key_id": s3.key_id, "secret_key": s3.secret_key, "region": REGION, "session_token": "", "profile": ""}
    wrong = {**entry, "key_id": WRONG_KEY["AWS_ACCESS_KEY_ID"]}
    # The longest key that prefixes the URL wins: the wrong default entry is not used for this bucket.
    credentials.write_text(json.dumps({"s3": {"": wrong, url.removesuffix("repo"): entry}}))
    env = {**WRONG_KEY, "TRITON_CLOUD_CREDENTIAL_PATH": str(credentials)}
    server = launch(f"--model-repository={url}", env=env).wait_live()
    _echo(server.url, "echo", [1.0, 2.0])


def test_a_key_that_goes_wrong_fails_the_load_and_the_models_keep_serving(
    launch: Launch, s3: S3Server, tmp_path: Path
) -> None:
    url = _bucket(s3, "credentials", tmp_path, "echo", "second")
    credentials = tmp_path / "cloud_credential.json"
    entry = {"key_id": s3.key_id, "secret_key": s3.secret_key, "region": REGION, "session_token": "", "profile": ""}
    credentials.write_text(json.dumps({"s3": {url: entry}}))
    env = {"TRITON_CLOUD_CREDENTIAL_PATH": str(credentials), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}
    server = launch(
        f"--model-repository={url}", "--model-control-mode=explicit", "--load-model=echo", env=env
    ).wait_live()
    _echo(server.url, "echo", [1.0])
    with httpclient.InferenceServerClient(server.url) as client:
        for broken, words in (
            ({"s3": {url: {**entry, "secret_key": "wrong"}}}, f"failed to read model repository '{url}'"),
            ("{not json", "cannot read the cloud credential file"),
        ):
            credentials.write_text(broken if isinstance(broken, str) else json.dumps(broken))
            with pytest.raises(InferenceServerException) as failed:
                client.load_model("second")
            assert "failed to load 'second', " in str(failed.value)
            assert words in str(failed.value)
            _echo(server.url, "echo", [2.0])
            _echo_grpc(server, "echo", [2.5])
        credentials.write_text(json.dumps({"s3": {"": entry}}))
        client.load_model("second")
        _echo(server.url, "second", [3.0])


def test_a_bucket_that_does_not_exist_stops_the_start_naming_the_url(launch: Launch, s3: S3Server) -> None:
    url = s3.url("no-such-bucket", "repo")
    server = launch(f"--model-repository={url}", env=s3.credentials)
    assert server.wait_exit() != 0
    assert f"failed to read model repository '{url}'" in server.log()
    assert "NoSuchBucket" in server.log()


@pytest.mark.parametrize(
    ("location", "store"),
    [
        ("gs://bucket/models", "Google Cloud Storage (gs://)"),
        ("as://account/container/models", "Azure Storage (as://)"),
    ],
)
def test_other_object_stores_are_refused_naming_the_scheme(launch: Launch, location: str, store: str) -> None:
    server = launch(f"--model-repository={location}")
    assert server.wait_exit() == 2
    assert f"model repository '{location}': {store} repositories are not supported" in server.log()


def test_a_malformed_s3_url_is_refused(launch: Launch) -> None:
    server = launch("--model-repository=s3://Bad_Bucket:port/models")
    assert server.wait_exit() == 2
    assert "model repository 's3://Bad_Bucket:port/models': not an S3 URL" in server.log()


def _strings(url: str, count: int, size: int) -> None:
    """A BYTES tensor of `count` elements of `size` bytes through the `strings` identity model: past 256 KiB, the
    server checks it on a thread of the loop's default pool."""
    data = np.array([bytes([65 + index % 26]) * size for index in range(count)], dtype=np.object_)
    with httpclient.InferenceServerClient(url, network_timeout=10, connection_timeout=5) as client:
        tensor = httpclient.InferInput("INPUT0", [count], "BYTES")
        tensor.set_data_from_numpy(data, binary_data=True)
        output = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
        result = client.infer("strings", [tensor], outputs=[output]).as_numpy("OUTPUT0")
        assert result is not None and result.tolist() == data.tolist()


def test_a_store_that_hangs_holds_up_neither_requests_nor_the_index(
    launch: Launch, s3: S3Server, tmp_path: Path
) -> None:
    url = _bucket(s3, "hangs", tmp_path, "echo")
    strings = write_identity_model(tmp_path / "source", "strings", dtype="TYPE_STRING", max_batch_size=0)
    s3.upload(strings, "hangs", "repo")
    server = launch(
        f"--model-repository={url}", "--model-control-mode=poll", "--repository-poll-secs=1", env=s3.credentials
    ).wait_live()
    _strings(server.url, 1000, 300)
    took: dict[str, float] = {}

    def timed(name: str, work: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            started = time.monotonic()
            work()
            took[name] = time.monotonic() - started

        return run

    def index() -> None:
        with httpclient.InferenceServerClient(server.url, network_timeout=10, connection_timeout=5) as client:
            entries = {(entry["name"], entry.get("state")) for entry in client.get_model_repository_index()}
            assert entries == {("echo", "READY"), ("strings", "READY")}

    with s3.hung():
        time.sleep(2.5)  # a poll is waiting on the store by now
        # More index calls than any host's default pool has threads (32 at most), beside requests whose work leaves
        # the loop: a 300 KiB BYTES tensor, checked on a thread.
        tasks = [timed(f"index {number}", index) for number in range(40)]
        tasks += [timed(f"BYTES {number}", lambda: _strings(server.url, 1000, 300)) for number in range(4)]
        tasks.append(timed("echo", lambda: _echo(server.url, "echo", [1.0, 2.0])))
        run_on_threads(tasks, timeout_s=30)
    assert len(took) == len(tasks)
    assert max(took.values()) < 5, took
    # The store answers again: polls go on, and a new model is served.
    s3.upload(write_identity_model(tmp_path / "later", "added"), "hangs", "repo")
    with httpclient.InferenceServerClient(server.url) as client:
        _wait_for(lambda: client.is_model_ready("added"))
    _echo(server.url, "added", [3.0])


@pytest.mark.parametrize("frontend_processes", [1, 2])
def test_sigterm_while_a_call_to_the_store_hangs_ends_the_server_at_once(
    launch: Launch, s3: S3Server, tmp_path: Path, frontend_processes: int
) -> None:
    url = _bucket(s3, f"sigterm-{frontend_processes}", tmp_path, "echo")
    server = launch(
        f"--model-repository={url}",
        "--model-control-mode=poll",
        "--repository-poll-secs=1",
        "--exit-timeout-secs=5",
        f"--frontend-processes={frontend_processes}",
        env=s3.credentials,
    ).wait_live()
    _echo(server.url, "echo", [1.0])
    with s3.hung():
        time.sleep(2.5)  # a poll is waiting on the store by now, for up to its timeouts (about 20 s)
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        status = server.wait_exit(timeout_s=30)
        took = time.monotonic() - started
    assert status == 0, server.log()
    # Nothing is left to drain: the hung call is abandoned, not waited out.
    assert took < 4, f"exited {took:.1f} s after SIGTERM\n{server.log()}"
    assert not descendants(server.process.pid)
