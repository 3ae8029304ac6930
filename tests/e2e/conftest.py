"""One real local Ray Serve deployment of the decoupled service for the whole e2e session.

Draft and Target each ask for num_gpus: 1; the local cluster has 2 logical GPUs, so the production placement is
exercised on CPU. Ray lives in a private temp dir and is shut down with ray.shutdown() (never `ray stop`).
"""
import pytest

from evospec.orchestration.config import DEFAULT_CONFIG, AppConfig
from evospec.orchestration.local import free_port, local_ray, serve_app


@pytest.fixture(scope="session")
def service():
    cfg = AppConfig.from_yaml(DEFAULT_CONFIG)
    # Every request drafts its full tree (no load-adaptive depth), so statistics and seeded samples can be compared
    # with the per-request loop exactly; the adaptive depth is tested against the stream in test_internal_protocol.
    scheduler = cfg.target.scheduler.model_copy(update={"adaptive": False})
    cfg = cfg.model_copy(update={"grpc_port": free_port(), "http_port": free_port(),
                                 "target": cfg.target.model_copy(update={"scheduler": scheduler})})
    with local_ray(num_cpus=4), serve_app(cfg) as address:
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
