"""One mapping from our exceptions to gRPC status codes, for plain grpc servers and for Serve deployments."""
from __future__ import annotations

import grpc

from evospec.errors import InvalidRequestError, OverloadedError

STATUS_OF = {InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
             OverloadedError: grpc.StatusCode.RESOURCE_EXHAUSTED,
             TimeoutError: grpc.StatusCode.DEADLINE_EXCEEDED}


def status_for(exc: BaseException) -> grpc.StatusCode:
    for cls, code in STATUS_OF.items():
        if isinstance(exc, cls):
            return code
    code_name = getattr(exc, "code_name", None)  # an internal call failed: pass its status through
    if code_name is not None:
        return grpc.StatusCode[code_name]
    return grpc.StatusCode.INTERNAL


def set_status(context, exc: BaseException) -> None:
    """Set code and details on a grpc (or Serve gRPC) context before re-raising."""
    context.set_code(status_for(exc))
    context.set_details(f"{type(exc).__name__}: {exc}")
