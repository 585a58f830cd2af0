"""A TLS server on 127.0.0.1 whose certificate no client trusts (self-signed, made for the test):
what a client meets when its CA bundle lacks the one that signed a store's certificate.

    with UntrustedTLS(tmp_path) as url:     # https://127.0.0.1:PORT; the cert files live in tmp_path
        ...

Made with ``cryptography`` (a dependency of moto, which the remote-store tests use already).
"""
from __future__ import annotations

import datetime
import http.server
import ssl
import threading
from pathlib import Path


def _self_signed(folder: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


class UntrustedTLS:
    """An HTTPS file server (serving nothing useful: clients stop at the handshake) in a thread."""

    def __init__(self, folder: Path):
        self.folder = folder

    def __enter__(self) -> str:
        cert, key = _self_signed(self.folder)
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return f"https://127.0.0.1:{self.server.server_address[1]}"

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)
        for name in ("cert.pem", "key.pem"):
            (self.folder / name).unlink(missing_ok=True)
