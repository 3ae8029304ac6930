"""Target Ray Serve deployment: a thin shim that builds the transport-free TargetServer (with a pool of streams to
the Draft deployment) and exposes its gRPC front as Serve's gRPC ingress. Serve's proxy calls methods named like
the RPCs of evospec.v1.Generate (and grpc.health.v1.Health/Check), so those names are forwarded here.
"""
from __future__ import annotations

from ray import serve

from evospec.services.common.metrics import ServiceMetrics
from evospec.services.config import TargetServiceConfig
from evospec.services.target.grpc_api import GrpcFront
from evospec.services.target.remote_draft import RemoteDraftPool
from evospec.services.target.server import DraftSide, TargetServer


@serve.deployment(name="Target")
class TargetDeployment:
    def __init__(self, draft, config: dict):
        cfg = TargetServiceConfig(**config)
        self.pool = RemoteDraftPool(lambda: draft.address.remote(), cfg.internal_timeout_s)
        drafts = DraftSide(self.pool, model_name=lambda: draft.model.remote(),
                           num_sessions=lambda: draft.num_sessions.remote())
        self.server = TargetServer.from_config(cfg, drafts, ServiceMetrics())
        self.grpc = GrpcFront(self.server)

    async def Generate(self, request, grpc_context=None):
        async for response in self.grpc.Generate(request, grpc_context):
            yield response

    async def GenerateOnce(self, request, grpc_context=None):
        return await self.grpc.GenerateOnce(request, grpc_context)

    async def Info(self, request, grpc_context=None):
        return await self.grpc.Info(request, grpc_context)

    async def Check(self, request, grpc_context=None):
        """grpc.health.v1.Health/Check, routed here by Serve's gRPC proxy."""
        from grpc_health.v1 import health_pb2
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    async def num_sessions(self) -> dict:
        """Live generations on both sides (for tests and operators)."""
        return {"target": self.server.num_sessions(), "draft": await self.server.drafts.num_sessions()}

    def __del__(self):
        server = getattr(self, "server", None)
        if server is not None:
            server.close()
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.close()
