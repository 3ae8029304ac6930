"""One mapping from our exceptions to gRPC status codes, for plain grpc servers and for Serve deployments.

Client mistakes carry their message (the field and what to send instead); anything else is INTERNAL with only a
request id, and its details go to the server log: a status never leaks internals (paths, types, tracebacks)."""
from __future__ import annotations

import logging

import grpc

from evospec.errors import (
    EngineStoppedError,
    InvalidRequestError,
    OverloadedError,
    ShuttingDownError,
    UnauthenticatedError,
)

log = logging.getLogger(__name__)
INTERNAL_ERROR = "internal error (request "  # how every INTERNAL message starts (the proxy policy keeps ours)

STATUS_OF = {InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
             UnauthenticatedError: grpc.StatusCode.UNAUTHENTICATED,
             ShuttingDownError: grpc.StatusCode.UNAVAILABLE,  # before its base class: another replica can serve it
             OverloadedError: grpc.StatusCode.RESOURCE_EXHAUSTED,
             EngineStoppedError: grpc.StatusCode.UNAVAILABLE,
             TimeoutError: grpc.StatusCode.DEADLINE_EXCEEDED}


def status_for(exc: BaseException) -> grpc.StatusCode:
    for cls, code in STATUS_OF.items():
        if isinstance(exc, cls):
            return code
    code_name = getattr(exc, "code_name", None)  # an internal call failed: pass its status through
    if code_name is not None:
        return grpc.StatusCode[code_name]
    return grpc.StatusCode.INTERNAL


def public_details(exc: BaseException, request_id: str = "") -> str:
    """What a caller may read about `exc`: our own errors' messages; for anything else a request id to quote."""
    if status_for(exc) == grpc.StatusCode.INTERNAL:
        return f"{INTERNAL_ERROR}{request_id or 'unknown'}); see the server log"
    return str(exc)  # our own errors, or a status passed through from an internal call (made public there)


def set_status(context, exc: BaseException, request_id: str = "") -> None:
    """Set code and details on a grpc (or Serve gRPC) context before re-raising; unexpected errors are logged here
    with their request id."""
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("request %s failed", request_id or "unknown", exc_info=exc)
    context.set_code(code)
    context.set_details(public_details(exc, request_id))
