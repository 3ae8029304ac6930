"""An optional TLS port on Serve's gRPC proxy server (Serve has no TLS option): with EVOSPEC_TLS_CERT and
EVOSPEC_TLS_KEY (PEM file paths) in the proxy's environment, the proxy also listens with TLS on EVOSPEC_TLS_PORT
(default 9443), next to Serve's plaintext port. Nothing of Serve's is patched: the port is added to its server before
it starts."""
from __future__ import annotations

import logging
import os

import grpc

log = logging.getLogger("ray.serve")

TLS_CERT_ENV, TLS_KEY_ENV, TLS_PORT_ENV = "EVOSPEC_TLS_CERT", "EVOSPEC_TLS_KEY", "EVOSPEC_TLS_PORT"
DEFAULT_TLS_PORT = 9443


def install_tls(server) -> None:
    """A TLS port on the proxy's server when a certificate and key are configured (before the server starts)."""
    cert, key = os.environ.get(TLS_CERT_ENV), os.environ.get(TLS_KEY_ENV)
    if server is None or not (cert and key):
        return
    port = int(os.environ.get(TLS_PORT_ENV, DEFAULT_TLS_PORT))
    try:
        with open(key, "rb") as k, open(cert, "rb") as c:
            credentials = grpc.ssl_server_credentials([(k.read(), c.read())])
        server.add_secure_port(f"[::]:{port}", credentials)
    except Exception as exc:  # noqa: BLE001 - e.g. another proxy on this host holds the port: plaintext still works
        log.warning("evospec: no TLS port %d in this proxy: %s", port, exc)
        return
    log.info("evospec: TLS on port %d", port)
