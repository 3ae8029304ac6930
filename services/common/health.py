"""Health: one predicate per deployment, read by every way health is asked.

A predicate returns None while its deployment can serve, else one line saying why not. The Target's is
`TargetServer.health` (its scheduler thread alive and stepping), the Draft's is `DraftStreamServer.health` (its
speculation stream server up). Serve's `check_health` raises on it (Serve then replaces the replica), the standard
gRPC health service answers SERVING / NOT_SERVING from it (Check, List, and Watch, which streams each change), and
the Target's `GET /health` answers 200 / 503.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

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


def list_response(predicate: HealthPredicate, known: tuple[str, ...]) -> health_pb2.HealthListResponse:
    """grpc.health.v1 List: every service this server has, with its status (one predicate: all alike)."""
    return health_pb2.HealthListResponse(statuses={service: check_response(predicate, service, known)
                                                   for service in known})


async def watch_responses(predicate: HealthPredicate, service: str, known: tuple[str, ...],
                          ending: Callable[[], bool], every_s: float = 1.0
                          ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
    """grpc.health.v1 Watch: the status now, then each change (the predicate read every `every_s`). An unknown
    service gets SERVICE_UNKNOWN and the stream stays open, as the protocol asks; it ends once `ending()` (the
    replica is going away: the client then watches another)."""
    last = None
    while True:
        status = check_response(predicate, service, known).status
        if status != last:
            yield health_pb2.HealthCheckResponse(status=status)
            last = status
        if ending():
            return
        await asyncio.sleep(every_s)


class PredicateHealthServicer(health.HealthServicer):
    """The standard health service of a plain grpc server, its Check answered by the deployment's predicate."""

    def __init__(self, predicate: HealthPredicate, known: tuple[str, ...] = ("",)):
        super().__init__()
        self.predicate, self.known = predicate, known

    def Check(self, request, context):
        return check_response(self.predicate, request.service, self.known, context)
