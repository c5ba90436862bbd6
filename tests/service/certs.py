"""A throwaway PKI for TLS tests, made with the `openssl` command: one CA, a server certificate
for 127.0.0.1/localhost and a client certificate, all ECDSA P-256, keys in PKCS#8 PEM."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
_SERVER_EXT = """basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1, DNS:localhost
"""
_CLIENT_EXT = """basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = clientAuth
subjectAltName = DNS:deja-gateway
"""


@dataclass(frozen=True)
class Pki:
    ca: Path
    """The CA certificate: it signs both certificates below."""
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _leaf(d: Path, name: str, ext: str) -> tuple[Path, Path]:
    (d / f"{name}.ext").write_text(ext)
    _openssl("req", "-new", *_EC, "-subj", f"/CN=deja test {name}",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)  # fmt: skip
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "1", "-extfile", f"{name}.ext",
             "-out", f"{name}.pem", cwd=d)  # fmt: skip
    return d / f"{name}.pem", d / f"{name}.key"


def make_pki(d: Path) -> Pki:
    """Writes ca.pem, server.pem/.key and client.pem/.key into `d` (fails without openssl)."""
    d.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", *_EC, "-days", "1", "-subj", "/CN=deja test CA",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=d)  # fmt: skip
    server_cert, server_key = _leaf(d, "server", _SERVER_EXT)
    client_cert, client_key = _leaf(d, "client", _CLIENT_EXT)
    return Pki(d / "ca.pem", server_cert, server_key, client_cert, client_key)
