"""Target Ray Serve deployment: a thin shim that builds the transport-free TargetServer (with a pool of streams to
the Draft deployment) and exposes its two fronts on Serve's two proxies:

- gRPC: Serve's gRPC proxy calls methods named like the RPCs of evospec.v1.Generate (and grpc.health.v1.Health/Check),
  so those names are forwarded to the GrpcFront;
- HTTP: the replica's FastAPI app (`__serve_build_asgi_app__`, built after __init__) serves the OpenAI-compatible
  routes and /metrics of the OpenAIFront on Serve's HTTP port.
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable

import ray
from ray import serve

from evospec.services.common.health import check_response, list_response, raise_if_unhealthy, watch_responses
from evospec.services.common.logs import log_to_serve
from evospec.services.common.metrics import HttpMetrics, ServiceMetrics
from evospec.services.config import DraftLinkConfig, TargetServiceConfig
from evospec.services.target.draft_link import DraftReplicas
from evospec.services.target.grpc_api import GrpcFront
from evospec.services.target.openai_api import OpenAIFront, build_http_app
from evospec.services.target.server import DraftSide, TargetServer

log = logging.getLogger("ray.serve")
HEALTH_SERVICES = ("", "evospec.v1.Generate")  # what grpc.health.v1 Check answers for (the server, the public API)


def serve_discovery(draft, link: DraftLinkConfig) -> Callable[[], set[str]]:
    """The Draft deployment's replica addresses, found through Serve: `address` calls on its handle (Serve routes
    each to a live replica) until `link.replicas` distinct addresses answered or a few more calls found nothing
    new. A replica that Serve restarted or replaced answers with its new address."""
    def discover() -> set[str]:
        found, error = set(), None
        deadline = time.monotonic() + 2 * link.probe_timeout_s  # one round never holds up the health probes long
        for _ in range(4 * link.replicas + 4):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                found.add(draft.address.remote().result(timeout_s=min(link.probe_timeout_s, remaining)))
            except Exception as exc:  # noqa: BLE001 - a replica starting, frozen or dying: ask again
                error = exc
            if len(found) >= link.replicas:
                break
        if not found and error is not None:
            raise error
        return found
    return discover


def served_model_name(cfg: TargetServiceConfig, model_folder: str) -> str:
    """The `model` of the OpenAI API: the configured name, else the target folder's name."""
    return cfg.public.served_model_name or model_folder.rstrip("/").rsplit("/", 1)[-1]


@serve.deployment(name="Target")
@serve.ingress()
class TargetDeployment:
    def __init__(self, draft, config: dict):
        log_to_serve()
        cfg = TargetServiceConfig(**config)
        self.pool = DraftReplicas(serve_discovery(draft, cfg.draft_link), cfg.draft_link)
        drafts = DraftSide(self.pool, model_name=lambda: draft.model.remote(),
                           num_sessions=lambda: draft.num_sessions.remote(),
                           adapt_stats=lambda: draft.adapt_stats.remote())
        self.server = TargetServer.from_config(cfg, drafts)
        model_name = served_model_name(cfg, self.server.model_name)
        self.http_metrics = HttpMetrics(model_name)
        self.server.metrics = (ServiceMetrics(), self.http_metrics.service)
        self.grpc = GrpcFront(self.server)
        self.http = OpenAIFront(self.server, cfg.public, model_name, self.http_metrics)
        # Requests that arrive before a draft replica answers run target-only and resume speculation later.
        if not self.pool.wait_healthy(cfg.draft_link.replicas, cfg.draft_link.startup_wait_s):
            log.warning("target started with draft replicas %s", self.pool.describe())
        else:
            self._start_from_draft_costs(draft, cfg.draft_link.costs_timeout_s)

    def _start_from_draft_costs(self, draft, timeout_s: float) -> None:
        """The budget's draft prior from a draft replica's forwards, timed now that this replica's start-up
        forwards are done (else the budget keeps its optimistic guess and learns from the first steps). The handle
        is waited on from a thread: this runs on the replica's event loop."""
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="draft-costs") as pool:
            try:
                costs = pool.submit(lambda: draft.costs.remote().result(timeout_s=timeout_s)).result()
            except Exception as exc:  # noqa: BLE001 - a replica restarting: the budget learns the costs as it drafts
                log.warning("draft costs not available (%s): the budget learns them from its first steps", exc)
                return
        self.server.calibrate_draft(costs)

    async def Generate(self, request, grpc_context=None):
        async for response in self.grpc.Generate(request, grpc_context):
            yield response

    async def GenerateOnce(self, request, grpc_context=None):
        return await self.grpc.GenerateOnce(request, grpc_context)

    async def Info(self, request, grpc_context=None):
        return await self.grpc.Info(request, grpc_context)

    def __serve_build_asgi_app__(self):
        """Serve's HTTP proxy routes to this app (route_prefix /)."""
        return build_http_app(self.http)

    async def Check(self, request, grpc_context=None):
        """grpc.health.v1.Health/Check, routed here by Serve's gRPC proxy: the deployment's one predicate."""
        return check_response(self.server.health, request.service, HEALTH_SERVICES, grpc_context)

    async def Watch(self, request, grpc_context=None):
        """grpc.health.v1.Health/Watch (load balancers use it): the status now, then each change."""
        async for response in watch_responses(self.server.health, request.service, HEALTH_SERVICES,
                                              ending=lambda: not self.server.replica.runner.running):
            yield response

    async def List(self, request, grpc_context=None):
        """grpc.health.v1.Health/List: every service this server answers health for, with its status."""
        return list_response(self.server.health, HEALTH_SERVICES)

    def check_health(self) -> None:
        """Serve's health check (every replica.health_check_period_s): a replica whose scheduler thread died or
        hangs fails it, and Serve replaces it."""
        raise_if_unhealthy(self.server.health)

    def placement(self) -> dict:
        """The node this replica runs on and the resources it holds (operators, the two-node test)."""
        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "resources": context.get_assigned_resources()}

    def profile(self, reset: bool = False) -> dict:
        """Where this replica's engine steps spent their time since the last reset (StepProfile.as_dict; `evospec
        bench decoupled --breakdown`)."""
        profile = self.server.scheduler.profile
        snapshot = profile.as_dict()
        if reset:
            profile.reset()
        return snapshot

    def draft_replicas(self) -> list[dict]:
        """The draft replicas this target replica knows, with their health (operators, tests)."""
        return self.pool.describe()

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
