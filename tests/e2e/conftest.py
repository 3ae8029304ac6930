"""One real local Ray Serve deployment of the decoupled service for the whole e2e session, on two Ray nodes.

The cluster has two nodes on this machine (ray.cluster_utils.Cluster), each with logical GPUs and a custom
resource (`target_node`, `draft_node`); config pins Target to one and Draft to the other, so every e2e test streams
across nodes with the production `num_gpus: 1` placement. Ray lives in a private temp dir and is shut down with
ray.shutdown() (never `ray stop`). Chaos tests (marker `chaos`) kill replicas, so they run last.
"""
import os

import pytest

from evospec.orchestration.config import DEFAULT_CONFIG, AppConfig
from evospec.orchestration.local import TWO_NODES, free_port, local_ray, placed_on_nodes, serve_app


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.get_closest_marker("chaos") is not None)  # stable: the rest keep their order


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory) -> dict:
    """A self-signed certificate for 127.0.0.1, given to Serve's proxy through the environment (ingress.py), so the
    service also answers TLS on `port`."""
    x509 = pytest.importorskip("cryptography.x509")
    import datetime
    import ipaddress

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    folder = tmp_path_factory.mktemp("tls")
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    return {"cert": str(folder / "cert.pem"), "key": str(folder / "key.pem"), "port": free_port()}


@pytest.fixture(scope="session")
def service(tls_files):
    from evospec.services.target.ingress import TLS_CERT_ENV, TLS_KEY_ENV, TLS_PORT_ENV
    # Ray's processes inherit the environment of the driver that starts the cluster: the proxy reads these.
    os.environ.update({TLS_CERT_ENV: tls_files["cert"], TLS_KEY_ENV: tls_files["key"],
                       TLS_PORT_ENV: str(tls_files["port"])})
    cfg = placed_on_nodes(AppConfig.from_yaml(DEFAULT_CONFIG))
    # Every request drafts its full tree (no load-adaptive depth) from its first step (the draft prefills with the
    # target), so statistics and seeded samples can be compared with the per-request loop exactly; the adaptive
    # depth and the deferred draft prefill are tested against the stream in test_internal_protocol.
    scheduler = cfg.target.scheduler.model_copy(update={"adaptive": False, "draft_prefill": "with_target"})
    # Serve checks the Target's health every 2 s (default 10), so a replica whose engine died is replaced quickly.
    replica = cfg.target.replica.model_copy(update={"health_check_period_s": 2.0})
    cfg = cfg.model_copy(update={"grpc_port": free_port(), "http_port": free_port(),
                                 "target": cfg.target.model_copy(update={"scheduler": scheduler,
                                                                         "replica": replica})})
    with local_ray(num_cpus=4, nodes=TWO_NODES), serve_app(cfg) as address:
        yield address, cfg


@pytest.fixture(scope="session")
def client(service):
    from evospec_client import EvoSpecClient
    with EvoSpecClient(service[0], timeout=120) as c:
        c.wait_ready(timeout=120)
        yield c


@pytest.fixture(scope="session")
def in_process():
    from evospec.loading import load_pair
    return load_pair()
