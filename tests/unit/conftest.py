"""Fixtures shared by the unit tests."""
import pytest

from evospec.services.config import DraftLinkConfig, DraftServiceConfig, InternalStreamConfig
from evospec.services.draft.server import DraftServer
from evospec.services.draft.servicer import start_draft_server
from evospec.services.target.draft_link import DraftReplicas

DRAFT_SECRET = "test-secret-0123456789abcdef"


@pytest.fixture(scope="module")
def tiny_draft_replica():
    """The tiny pair's DraftServer behind its authenticated internal stream on a loopback port, and a target's pool
    of streams to it: the service's draft side without Ray. Yields (draft server, port, pool)."""
    draft_cfg = DraftServiceConfig(internal=InternalStreamConfig(secret=DRAFT_SECRET))
    draft = DraftServer.from_config(draft_cfg)
    grpc_server, port = start_draft_server(draft, "127.0.0.1", draft_cfg.internal)
    pool = DraftReplicas(lambda: [f"127.0.0.1:{port}"], DraftLinkConfig(secret=DRAFT_SECRET, step_timeout_s=10))
    assert pool.wait_healthy(1, timeout_s=30)
    yield draft, port, pool
    pool.close()
    grpc_server.stop(grace=None)


@pytest.fixture(params=["verify_each", "verify_on_device"])
def verification(request, monkeypatch):
    """Each implementation of the target engine's batched verification in turn, both on the CPU: `verify_batch`
    takes verify_each on a CPU and verify_on_device (batch-first) on an accelerator (evospec/verify.py)."""
    from evospec import verify
    monkeypatch.setattr("evospec.engine.target.verify_batch", getattr(verify, request.param))
    return request.param
