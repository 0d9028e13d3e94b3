"""Every tritonserver flag is geserve's, ignored with a warning, or refused naming it; never a bare argparse error."""

from __future__ import annotations

import pytest

from geserve import triton_flags
from geserve.cli import parse_settings
from geserve.flags import build_parser


def test_every_tritonserver_flag_is_known() -> None:
    known = set(build_parser()._option_string_actions)
    missing = [flag for flag in triton_flags.TRITONSERVER_FLAGS if flag not in known]
    assert missing == []


@pytest.mark.parametrize(
    ("flag", "warning"),
    [
        ("--grpc-infer-thread-count=4", "ignoring --grpc-infer-thread-count: gRPC is served by one event loop"),
        ("--grpc-max-response-pool-size=8", "ignoring --grpc-max-response-pool-size: gRPC responses are not pooled"),
        ("--enable-peer-access=false", "ignoring --enable-peer-access: geserve does not run on CUDA devices"),
        (
            "--backend-config=onnxruntime,default-max-batch-size=4",
            "ignoring --backend-config=onnxruntime,default-max-batch-size=4: auto-complete gives ONNX models 4 already",
        ),
    ],
)
def test_tuning_flags_geserve_did_not_know_are_warned(flag: str, warning: str) -> None:
    options = parse_settings(["--model-repository=/a", flag])
    assert options.server.warnings == (warning,)
    assert options.repository.paths[0].name == "a"


def test_pinned_memory_pool_warning_says_where_batches_go() -> None:
    options = parse_settings(["--model-repository=/a", "--pinned-memory-pool-byte-size=268435456"])
    assert options.server.warnings == (
        "ignoring --pinned-memory-pool-byte-size: geserve has no pinned memory pool; batches travel in each "
        "worker's shared-memory arenas (--worker-arena-size)",
    )


def test_default_max_batch_size_refusal_says_what_auto_complete_does(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as error:
        parse_settings(["--model-repository=/a", "--backend-config=default-max-batch-size=8"])
    assert error.value.code == 2
    err = capsys.readouterr().err
    assert "--backend-config=default-max-batch-size=8 is not supported" in err
    assert "batchable ONNX model max_batch_size 4" in err
    assert "does not invent" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--no-such-flag=1"], "--no-such-flag is not a geserve or tritonserver flag"),
        (["--no-such-flag", "1"], "--no-such-flag is not a geserve or tritonserver flag; unrecognized arguments: 1"),
    ],
)
def test_an_unknown_flag_is_named_with_whose_it_is(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as error:
        parse_settings(["--model-repository=/a", *argv])
    assert error.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {message}\n" in err


@pytest.mark.parametrize(
    ("address", "host"),
    [
        ("ipv6:[::1]", "::1"),
        ("ipv6:::1", "::1"),
        ("ipv6:[::]", "::"),
        ("ipv4:127.0.0.1", "127.0.0.1"),
        ("::1", "::1"),
        ("[::1]", "::1"),  # bracketed without the prefix, as tritonserver's gRPC address takes it
    ],
)
def test_tritons_address_syntax_is_the_bare_host(address: str, host: str) -> None:
    options = parse_settings(["--model-repository=/a", f"--http-address={address}", f"--grpc-address={address}"])
    assert (options.http.address, options.grpc.address, options.metrics.address) == (host, host, host)


def test_a_bad_ipv6_address_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_settings(["--model-repository=/a", "--grpc-address=ipv6:[nope]"])
    assert "--grpc-address=ipv6:[nope] is not an IPv6 address" in capsys.readouterr().err


def test_a_tritonserver_flag_without_a_geserve_flag_is_named_as_tritons() -> None:
    # Called directly: every tritonserver flag has a geserve flag today, so none reaches it from the command line.
    assert triton_flags.unrecognized(["--model-load-gpu-limit=0:0.5", "--no-such-flag"]) == (
        "--model-load-gpu-limit is a tritonserver flag geserve does not handle; --no-such-flag is not a geserve or "
        "tritonserver flag"
    )
