"""One real local Ray Serve deployment of the decoupled service for the whole e2e session, on two Ray nodes.

The cluster has two nodes on this machine (ray.cluster_utils.Cluster), each with logical GPUs and a custom
resource (`target_node`, `draft_node`); config pins Target to one and Draft to the other, so every e2e test streams
across nodes with the production `num_gpus: 1` placement. Ray lives in a private temp dir and is shut down with
ray.shutdown() (never `ray stop`). Chaos tests (marker `chaos`) kill replicas, so they run last.
"""
import pytest

from evospec.orchestration.config import DEFAULT_CONFIG, AppConfig
from evospec.orchestration.local import TWO_NODES, free_port, local_ray, placed_on_nodes, serve_app


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.get_closest_marker("chaos") is not None)  # stable: the rest keep their order


@pytest.fixture(scope="session")
def service():
    cfg = placed_on_nodes(AppConfig.from_yaml(DEFAULT_CONFIG))
    # Every request drafts its full tree (no load-adaptive depth), so statistics and seeded samples can be compared
    # with the per-request loop exactly; the adaptive depth is tested against the stream in test_internal_protocol.
    scheduler = cfg.target.scheduler.model_copy(update={"adaptive": False})
    cfg = cfg.model_copy(update={"grpc_port": free_port(), "http_port": free_port(),
                                 "target": cfg.target.model_copy(update={"scheduler": scheduler})})
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
