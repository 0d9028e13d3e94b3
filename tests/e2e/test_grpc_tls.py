"""gRPC over TLS and mutual TLS (--grpc-use-ssl, --grpc-use-ssl-mutual), with tritonclient's ssl options and
certificates made here; bad or missing files stop startup naming them."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from tritonclient.utils import InferenceServerException

from geserve.cli import parse_settings
from tests.support import GeserveProcess, copy_model

pytestmark = pytest.mark.e2e


def _issue(
    folder: Path, name: str, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None, server: bool = False
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A key and a certificate for `name`, signed by `issuer` (self-signed, a CA, without one); written as
    <name>.pem and <name>.key."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer[0].subject if issuer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if server:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    certificate = builder.sign(issuer[1] if issuer else key, hashes.SHA256())
    (folder / f"{name}.pem").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    (folder / f"{name}.key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return certificate, key


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("certificates")
    authority = _issue(folder, "ca", None)
    _issue(folder, "server", authority, server=True)
    _issue(folder, "client", authority)
    _issue(folder, "stranger", _issue(folder, "other_ca", None))  # a client no root of the server's signed
    return folder


def _infer(client: grpcclient.InferenceServerClient) -> None:
    data = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [grpcclient.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(data)
    np.testing.assert_array_equal(client.infer("simple", inputs).as_numpy("OUTPUT0"), data * 2)


def _client(
    server: GeserveProcess, certificates: Path, who: str = "", **options: object
) -> grpcclient.InferenceServerClient:
    identity = (
        {"private_key": str(certificates / f"{who}.key"), "certificate_chain": str(certificates / f"{who}.pem")}
        if who
        else {}
    )
    return grpcclient.InferenceServerClient(
        f"localhost:{server.grpc_port}",
        ssl=True,
        root_certificates=str(certificates / "ca.pem"),
        **identity,  # type: ignore[arg-type]
        **options,  # type: ignore[arg-type]
    )


def _tls_server(launch: Callable[..., GeserveProcess], folder: Path, certificates: Path, *flags: str) -> GeserveProcess:
    """A server of `simple` with the server's certificate and key, and `flags`."""
    repository = folder / "models"
    copy_model("simple", repository)
    return launch(
        f"--model-repository={repository}",
        f"--grpc-server-cert={certificates / 'server.pem'}",
        f"--grpc-server-key={certificates / 'server.key'}",
        *flags,
    ).wait_live()


def test_grpc_over_tls_serves_tls_clients_and_refuses_plain_ones(
    tmp_path: Path, certificates: Path, launch: Callable[..., GeserveProcess]
) -> None:
    server = _tls_server(launch, tmp_path, certificates, "--grpc-use-ssl=true")
    _infer(_client(server, certificates))
    plain = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    with pytest.raises(InferenceServerException) as error:
        plain.is_server_live(client_timeout=5)
    assert "StatusCode.UNAVAILABLE" in str(error.value.status()), error.value
    _infer(_client(server, certificates))  # the refused client changed nothing


def test_mutual_tls_serves_clients_with_certificates_from_its_root_only(
    tmp_path: Path, certificates: Path, launch: Callable[..., GeserveProcess]
) -> None:
    # --grpc-use-ssl-mutual implies --grpc-use-ssl, as in Triton.
    server = _tls_server(
        launch, tmp_path, certificates, "--grpc-use-ssl-mutual=true", f"--grpc-root-cert={certificates / 'ca.pem'}"
    )
    _infer(_client(server, certificates, "client"))
    for refused in (_client(server, certificates), _client(server, certificates, "stranger")):
        with pytest.raises(InferenceServerException):
            refused.is_server_live(client_timeout=5)
    _infer(_client(server, certificates, "client"))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--grpc-use-ssl"], "--grpc-use-ssl needs --grpc-server-cert and --grpc-server-key"),
        (
            ["--grpc-use-ssl-mutual", "--grpc-server-cert={c}/server.pem", "--grpc-server-key={c}/server.key"],
            "--grpc-use-ssl-mutual needs --grpc-root-cert",
        ),
        (
            ["--grpc-use-ssl", "--grpc-server-cert={c}/nowhere.pem", "--grpc-server-key={c}/server.key"],
            "--grpc-server-cert: cannot read '{c}/nowhere.pem': No such file or directory",
        ),
        (
            ["--grpc-use-ssl", "--grpc-server-cert={c}/server.pem", "--grpc-server-key={c}"],
            "--grpc-server-key: cannot read '{c}': Is a directory",
        ),
        (
            ["--grpc-use-ssl", "--grpc-server-cert={c}/server.pem", "--grpc-server-key={c}/empty.key"],
            "--grpc-server-key: '{c}/empty.key' holds no PEM block",
        ),
    ],
)
def test_a_bad_or_missing_tls_file_stops_startup_naming_it(
    certificates: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    (certificates / "empty.key").write_text("")
    with pytest.raises(SystemExit):
        parse_settings(["--model-repository=/nowhere", *(flag.format(c=certificates) for flag in flags)])
    assert message.format(c=certificates) in capsys.readouterr().err
