"""Typed errors. The gRPC layer maps each to one status code (see services/common/errors.py)."""
from __future__ import annotations


class EvoSpecError(Exception):
    """Base class of every error this package raises on purpose."""


class InvalidRequestError(EvoSpecError, ValueError):
    """The request cannot be served as given; `field` names what to fix (-> INVALID_ARGUMENT)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self):  # picklable (Ray ships exceptions between processes)
        return type(self), (self.field, self.message)


class UnauthenticatedError(EvoSpecError):
    """The call carries no valid credentials (-> UNAUTHENTICATED; HTTP 401)."""


class OverloadedError(EvoSpecError):
    """Too many concurrent generations (-> RESOURCE_EXHAUSTED)."""


class ShuttingDownError(OverloadedError):
    """This replica is stopping; another one can serve the request (-> UNAVAILABLE-like: HTTP 503 Retry-After)."""


class EngineStoppedError(EvoSpecError):
    """This replica's engine stopped unexpectedly; the replica is being replaced (-> UNAVAILABLE "target restarting,
    retry"; HTTP 503 Retry-After): a retry reaches a healthy replica."""
