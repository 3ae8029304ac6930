"""Typed client exceptions, one per gRPC status the service uses."""
from __future__ import annotations

import grpc


class EvoSpecClientError(Exception):
    code = grpc.StatusCode.UNKNOWN

    def __init__(self, details: str, code: grpc.StatusCode | None = None):
        super().__init__(details)
        self.details = details
        if code is not None:
            self.code = code


class InvalidArgument(EvoSpecClientError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(EvoSpecClientError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(EvoSpecClientError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(EvoSpecClientError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(EvoSpecClientError):
    code = grpc.StatusCode.CANCELLED


class NotFound(EvoSpecClientError):
    code = grpc.StatusCode.NOT_FOUND


class InternalError(EvoSpecClientError):
    code = grpc.StatusCode.INTERNAL


class Unauthenticated(EvoSpecClientError):
    """The service requires a bearer token: pass `token=` (or set EVOSPEC_API_TOKEN)."""
    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE = {cls.code: cls for cls in (InvalidArgument, ResourceExhausted, Unavailable, DeadlineExceeded, Cancelled,
                                      NotFound, InternalError, Unauthenticated)}


def from_rpc_error(err: grpc.RpcError) -> EvoSpecClientError:
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    return _BY_CODE.get(code, EvoSpecClientError)(details or code.name, code)
