"""Health: one predicate per deployment, read by every way health is asked.

A predicate returns None while its deployment can serve, else one line saying why not. The Target's is
`TargetServer.health` (its scheduler thread alive and stepping), the Draft's is `DraftStreamServer.health` (its
speculation stream server up). Serve's `check_health` raises on it (Serve then replaces the replica), the standard
gRPC health service answers SERVING / NOT_SERVING from it, and the Target's `GET /health` answers 200 / 503.
"""
from __future__ import annotations

from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2

HealthPredicate = Callable[[], "str | None"]


class UnhealthyError(RuntimeError):
    """Raised by a deployment's `check_health` (Serve marks the replica unhealthy and replaces it)."""


def raise_if_unhealthy(predicate: HealthPredicate) -> None:
    problem = predicate()
    if problem is not None:
        raise UnhealthyError(problem)


def check_response(predicate: HealthPredicate, service: str, known: tuple[str, ...],
                   context=None) -> health_pb2.HealthCheckResponse:
    """grpc.health.v1 Check: NOT_FOUND for a service this server does not have, else SERVING / NOT_SERVING."""
    if service not in known:
        if context is not None:
            context.set_code(grpc.StatusCode.NOT_FOUND)
            context.set_details(f"unknown service {service!r}; this server has {', '.join(map(repr, known))}")
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
    serving = predicate() is None
    return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING if serving
                                          else health_pb2.HealthCheckResponse.NOT_SERVING)


class PredicateHealthServicer(health.HealthServicer):
    """The standard health service of a plain grpc server, its Check answered by the deployment's predicate."""

    def __init__(self, predicate: HealthPredicate, known: tuple[str, ...] = ("",)):
        super().__init__()
        self.predicate, self.known = predicate, known

    def Check(self, request, context):
        return check_response(self.predicate, request.service, self.known, context)
