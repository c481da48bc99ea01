"""Bearer keys and TLS with client certificates (``--auth-file``, ``--tls-*``)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

import fencegate

from conftest import GatewayFactory
from harness import BINARY


@dataclass(frozen=True)
class Key:
    key: str
    hash: str


def new_key() -> Key:
    printed = subprocess.run([str(BINARY), "key", "new"], check=True, capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in printed.splitlines() if ":" in line)
    return Key(key=fields["key"].strip(), hash=fields["hash"].strip())


def write_auth_file(path: Path, writer: Key, reader: Key, certificate_name: str = "") -> Path:
    certificates = f'certificates = ["{certificate_name}"]' if certificate_name else ""
    path.write_text(
        f"""
[[identity]]
name = "sweeper-node-a"
keys = ["{writer.hash}"]
grants = [{{ resources = ["sweeper"], actions = ["read", "write", "advance", "lease"] }}]

[[identity]]
name = "auditor"
keys = ["{reader.hash}"]
{certificates}
grants = [{{ resources = ["sweeper"], actions = ["read", "write"] }}]
"""
    )
    return path


def test_bearer_keys_and_grants(gateways: GatewayFactory, tmp_path: Path) -> None:
    writer, reader = new_key(), new_key()
    process = gateways.start("--auth-file", str(write_auth_file(tmp_path / "auth.toml", writer, reader)))

    with fencegate.Gateway(process.url) as anonymous:
        with pytest.raises(fencegate.Unauthenticated) as no_key:
            anonymous.put("sweeper", "k", b"v", token=1)
        assert no_key.value.status == 401
        with pytest.raises(fencegate.Unauthenticated):
            anonymous.fence("sweeper")
    with (
        fencegate.Gateway(process.url, key="fgk_not-a-key-anyone-holds") as stranger,
        pytest.raises(fencegate.Unauthenticated),
    ):
        stranger.get("sweeper", "k")

    with (
        fencegate.Gateway(process.url, key=writer.key, holder="node-a") as gateway,
        gateway.lease("sweeper", ttl=10) as lease,
    ):
        assert gateway.read_lease("sweeper").identity == "sweeper-node-a"
        assert lease.put("k", b"v").version == 1
        with pytest.raises(fencegate.Forbidden) as not_granted:
            gateway.put("billing", "k", b"v", token=lease.token)
        assert not_granted.value.status == 403
        assert not isinstance(not_granted.value, fencegate.TransientError)

    with fencegate.Gateway(process.url, key=reader.key, holder="auditor") as auditor:
        stored = auditor.get("sweeper", "k")
        assert stored is not None and stored.value == b"v"
        with pytest.raises(fencegate.Forbidden):
            auditor.advance("sweeper", token=99)
        with pytest.raises(fencegate.Forbidden):
            auditor.acquire_lease("sweeper", ttl=10)
        assert auditor.fence("sweeper").highest == 1, "refused requests changed nothing"


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certificates(directory: Path) -> None:
    """A CA; a server certificate for 127.0.0.1; a client certificate for
    node-b.sweeper.internal, all signed by that CA."""
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-subj", "/CN=fencegate test CA", "-days", "2", "-keyout", "ca.key", "-out", "ca.crt",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign",
            cwd=directory)  # fmt: skip
    for name, extensions in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"),
        ("client", "subjectAltName=DNS:node-b.sweeper.internal\nextendedKeyUsage=clientAuth\n"),
    ):
        (directory / f"{name}.ext").write_text(extensions)
        openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=directory)  # fmt: skip
        openssl("x509", "-req", "-days", "2", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=directory)  # fmt: skip


def test_tls_with_a_ca_file_and_a_client_certificate(gateways: GatewayFactory, tmp_path: Path) -> None:
    make_certificates(tmp_path)
    writer, reader = new_key(), new_key()
    auth = write_auth_file(tmp_path / "auth.toml", writer, reader, certificate_name="node-b.sweeper.internal")
    process = gateways.start(
        "--auth-file", str(auth),
        "--tls-cert", str(tmp_path / "server.crt"),
        "--tls-key", str(tmp_path / "server.key"),
        "--tls-client-ca", str(tmp_path / "ca.crt"),
        scheme="https",
    )  # fmt: skip
    ca = str(tmp_path / "ca.crt")

    with fencegate.Gateway(process.url, ca_file=ca, key=writer.key) as by_key:
        assert by_key.put("sweeper", "k", b"over TLS", token=1).created

    with fencegate.Gateway(
        process.url, ca_file=ca, client_cert=str(tmp_path / "client.crt"), client_key=str(tmp_path / "client.key")
    ) as by_certificate:
        # The certificate's name is the auditor's: it may write, not advance.
        assert by_certificate.put("sweeper", "k", b"by certificate", token=1).version == 2
        with pytest.raises(fencegate.Forbidden):
            by_certificate.advance("sweeper", token=2)

    with fencegate.Gateway(process.url, ca_file=ca) as no_credentials, pytest.raises(fencegate.Unauthenticated):
        no_credentials.get("sweeper", "k")

    with fencegate.Gateway(process.url) as unknown_ca, pytest.raises(fencegate.GatewayUnreachable) as refused:
        unknown_ca.get("sweeper", "k")
    assert "CERTIFICATE_VERIFY_FAILED" in str(refused.value)
