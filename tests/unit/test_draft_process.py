"""A draft replica without Ray (orchestration/draft_process.py): it serves the authenticated speculation stream in a
process of its own, stops with its block, and a replica that cannot start says why instead of hanging."""
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from evospec.config import ModelConfig
from evospec.orchestration.draft_process import local_draft_replica
from evospec.services.config import DraftServiceConfig, InternalStreamConfig

pytestmark = [pytest.mark.process]

SECRET = "draft-process-secret-0123456789"


def health(address: str, secret: str | None) -> grpc.StatusCode | int:
    """The replica's health status, or the gRPC error code of the check."""
    metadata = [("authorization", f"Bearer {secret}")] if secret else []
    with grpc.insecure_channel(address) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5,
                                                             metadata=metadata).status
        except grpc.RpcError as error:
            return error.code()


def test_it_serves_the_stream_with_its_secret_and_stops_with_the_block():
    cfg = DraftServiceConfig(internal=InternalStreamConfig(secret=SECRET))
    with local_draft_replica(cfg) as address:
        assert health(address, SECRET) == health_pb2.HealthCheckResponse.SERVING
        assert health(address, "another-secret-0123456789") == grpc.StatusCode.UNAUTHENTICATED
    assert health(address, SECRET) == grpc.StatusCode.UNAVAILABLE


def test_a_replica_that_cannot_load_its_model_says_why():
    cfg = DraftServiceConfig(model=ModelConfig(path="/nonexistent/draft-model"))
    with pytest.raises(RuntimeError, match="draft replica process exited with code") as error:
        with local_draft_replica(cfg, start_timeout_s=120):
            pass
    assert "/nonexistent/draft-model" in str(error.value)


def test_a_replica_that_does_not_start_in_time_is_stopped_with_an_error():
    with pytest.raises(RuntimeError, match=r"printed no port within 0.5 s"):
        with local_draft_replica(DraftServiceConfig(), start_timeout_s=0.5):
            pass
