"""One health predicate per deployment (services/common/health.py): the Target's scheduler thread alive and stepping,
the Draft's stream server up; Serve's check_health, the gRPC health service and GET /health all read it.

A scheduler thread that dies fails what it held with UNAVAILABLE "target restarting, retry" (what the SDK retries)
and every health answer turns; a frozen step turns them within scheduler.stall_timeout_s. Through Serve (a replica
replaced after its scheduler thread died): tests/e2e/test_chaos.py."""
from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from evospec.config import SchedulerConfig
from evospec.services.common.health import UnhealthyError, raise_if_unhealthy
from evospec.services.config import DraftServiceConfig, InternalStreamConfig, TargetServiceConfig
from evospec.services.draft.server import DraftServer
from evospec.services.draft.servicer import start_draft_server
from evospec.services.target.deployment import HEALTH_SERVICES
from evospec.services.target.grpc_api import GrpcFront
from evospec.services.target.openai_api import OpenAIFront, build_http_app
from evospec.services.target.server import DraftSide, TargetServer
from evospec_client.api.v1 import generate_pb2 as pb

from .test_openai_api import raw

STALL_S = 1.0


class Context:
    """What the gRPC front reads and sets on Serve's request context."""

    def __init__(self):
        self.code = self.details = None

    def invocation_metadata(self):
        return ()

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details


@pytest.fixture
def target(tiny_draft_replica):
    """A fresh target server (its own scheduler thread, which the tests kill or freeze) over the tiny draft."""
    _, _, pool = tiny_draft_replica

    async def nothing():
        return 0
    cfg = TargetServiceConfig(scheduler=SchedulerConfig(adaptive=False, stall_timeout_s=STALL_S))
    server = TargetServer.from_config(cfg, DraftSide(pool, nothing, nothing))
    yield server, build_http_app(OpenAIFront(server, cfg.public, "tiny"))
    server.close()


def health_answers(server: TargetServer, app) -> tuple[int, int, bool]:
    """(gRPC Check status, GET /health status code, whether Serve's check_health passes)."""
    from evospec.services.common.health import check_response
    grpc_status = check_response(server.health, "", HEALTH_SERVICES).status
    http_status = asyncio.run(raw(app, "GET", "/health", key=None)).status_code
    try:
        raise_if_unhealthy(server.health)
        serve_ok = True
    except UnhealthyError:
        serve_ok = False
    return grpc_status, http_status, serve_ok


SERVING = (health_pb2.HealthCheckResponse.SERVING, 200, True)
NOT_SERVING = (health_pb2.HealthCheckResponse.NOT_SERVING, 503, False)


def stream(server: TargetServer, max_tokens: int, context: Context) -> list:
    request = pb.GenerateRequest(prompt="The patient was given aspirin because")
    request.sampling.max_tokens, request.sampling.ignore_eos = max_tokens, True

    async def collect():
        return [r async for r in GrpcFront(server).Generate(request, context)]
    return asyncio.run(asyncio.wait_for(collect(), 120))


class Killed(BaseException):
    """What ends the scheduler thread in these tests (no `except Exception` in the loop catches it)."""


def test_a_dead_scheduler_thread_fails_every_health_answer_and_its_requests_with_unavailable(target):
    server, app = target
    assert health_answers(server, app) == SERVING
    real_step, steps = server.scheduler.step, []

    def dying_step():
        steps.append(1)
        if len(steps) == 3:  # mid-generation
            raise Killed()
        real_step()
    server.scheduler.step = dying_step
    context = Context()
    with pytest.raises(Exception):
        stream(server, 64, context)
    assert context.code == grpc.StatusCode.UNAVAILABLE and context.details == "target restarting, retry"
    server.replica.runner._thread.join(10)
    assert not server.replica.runner._thread.is_alive()
    assert health_answers(server, app) == NOT_SERVING
    assert "not running" in server.health()
    context = Context()  # a new call is refused at once, the same way (the SDK retries it)
    with pytest.raises(Exception):
        stream(server, 4, context)
    assert context.code == grpc.StatusCode.UNAVAILABLE and context.details == "target restarting, retry"


def test_a_frozen_step_fails_health_within_the_stall_timeout_and_recovers(target):
    server, app = target
    thaw, frozen = threading.Event(), threading.Event()
    real_step = server.scheduler.step

    def freezing_step():
        frozen.set()
        thaw.wait(30)
        real_step()
    server.scheduler.step = freezing_step
    result = {}
    worker = threading.Thread(target=lambda: result.update(responses=stream(server, 4, Context())))
    worker.start()
    assert frozen.wait(30)
    start = time.monotonic()
    while server.health() is None and time.monotonic() - start < 10 * STALL_S:
        time.sleep(0.05)
    detected_s = time.monotonic() - start
    try:
        assert health_answers(server, app) == NOT_SERVING
        assert "stall_timeout_s" in server.health()
        assert STALL_S * 0.5 <= detected_s <= STALL_S + 1.0, detected_s
    finally:
        server.scheduler.step = real_step
        thaw.set()
        worker.join(60)
    assert result["responses"][-1].finish_reason == pb.FINISH_REASON_LENGTH  # it went on once thawed
    assert health_answers(server, app) == SERVING


def test_draft_health_is_its_stream_server_and_the_health_service_answers_from_it():
    draft_cfg = DraftServiceConfig(internal=InternalStreamConfig(secret="a-secret-0123456789abcdef"))
    draft = DraftServer.from_config(draft_cfg)
    stream_server, port = start_draft_server(draft, "127.0.0.1", draft_cfg.internal)
    metadata = (("authorization", "Bearer a-secret-0123456789abcdef"),)

    def probe(service: str = "") -> int:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                             metadata=metadata, timeout=10).status
    try:
        assert stream_server.health() is None and probe() == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            probe("no.such.Service")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        draft.shutdown()  # the server can no longer take sessions: targets must stop sending them here
        assert probe() == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(UnhealthyError, match="shut down"):
            raise_if_unhealthy(stream_server.health)
    finally:
        stream_server.stop(grace=None)
    assert "stopped" in stream_server.health()
