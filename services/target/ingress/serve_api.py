"""Patches Serve's gRPC proxy's own API (`gRPCProxy.routes_response`, `gRPCProxy.health_response`)."""
from __future__ import annotations

import logging
import os

import grpc

log = logging.getLogger("ray.serve")

EXPOSE_SERVE_API_ENV = "EVOSPEC_EXPOSE_SERVE_API"


def hide_serve_api() -> None:
    """Serve's own gRPC API (`ray.serve.RayServeAPIService`: ListApplications names every application, Healthz)
    answers on the public port to anyone; Serve registers it before any servicer function and has no option to
    leave it out. Its two answers are replaced by UNIMPLEMENTED, as for any method the server lacks, unless the
    operator opts in with EVOSPEC_EXPOSE_SERVE_API=1. Health is `grpc.health.v1.Health` (Check, Watch, List)."""
    if os.environ.get(EXPOSE_SERVE_API_ENV) == "1":
        return
    try:
        from ray.serve._private.proxy import gRPCProxy
        from ray.serve._private.proxy_request_response import ResponseStatus
    except ImportError as exc:
        log.warning("evospec: cannot hide Serve's gRPC API on this Ray version: %s", exc)
        return
    if getattr(gRPCProxy.routes_response, "evospec_policy", False):
        return

    async def unimplemented(self, *, healthy: bool, message: str):
        yield ResponseStatus(code=grpc.StatusCode.UNIMPLEMENTED, message="Method not found!", is_error=True)
    unimplemented.evospec_policy = True
    gRPCProxy.routes_response = gRPCProxy.health_response = unimplemented
