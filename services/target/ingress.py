"""What Serve's gRPC proxy tells clients when a target replica fails.

Serve 2.60's proxy turns a replica that died or became unreachable mid-request into INTERNAL, with the actor's id,
pid, name and namespace in the message. We want UNAVAILABLE "target restarting, retry" (the SDK retries it before
the first message) and no internals. Serve has no hook for this, so `install_error_policy` is registered as one of
the proxy's gRPC servicer functions (orchestration/app.py), which Serve imports and calls inside the proxy process
at start-up, and it wraps the proxy's status mapping there:

- a dead or unreachable replica (RayActorError) -> UNAVAILABLE "target restarting, retry";
- any other Ray-level error (RayTaskError: an exception our fronts did not map) -> INTERNAL "internal error
  (request <id>)"; the details stay in the proxy's log;
- every status our fronts set themselves (InvalidArgument, ResourceExhausted, ...) passes unchanged.

If a Ray upgrade renames what it wraps, the policy logs a warning and leaves Serve's behaviour alone
(tests/e2e/test_chaos.py fails then).
"""
from __future__ import annotations

import dataclasses
import logging

import grpc

log = logging.getLogger("ray.serve")

TARGET_RESTARTING = "target restarting, retry"


def public_status(exc: BaseException, status, request_id: str):
    """The status a client may see for `exc`, given the one Serve computed (a ResponseStatus)."""
    from ray.exceptions import RayActorError, RayTaskError
    original = getattr(exc, "original_exception", exc)  # Serve's gRPCStatusError wraps what a front raised
    if original is not exc and status.code != grpc.StatusCode.INTERNAL:
        return status  # a status our front set on purpose
    if isinstance(original, RayActorError) or isinstance(getattr(original, "cause", None), RayActorError):
        return dataclasses.replace(status, code=grpc.StatusCode.UNAVAILABLE, message=TARGET_RESTARTING)
    if isinstance(original, RayTaskError) or status.code == grpc.StatusCode.INTERNAL:
        return dataclasses.replace(status, code=grpc.StatusCode.INTERNAL,
                                   message=f"internal error (request {request_id}); see the server log")
    return status


def install_error_policy(servicer, server) -> None:
    """A Serve gRPC servicer function (called as `f(servicer, server)` in the proxy process) that registers no
    service: it wraps the proxy's exception -> status mapping with `public_status`."""
    try:
        from ray.serve._private import proxy
        original = proxy.get_grpc_response_status
    except (ImportError, AttributeError) as exc:
        log.warning("evospec: cannot install the public error policy on this Ray version: %s", exc)
        return
    if getattr(original, "evospec_policy", False):
        return

    def policy(exc, request_timeout_s, request_id):
        return public_status(exc, original(exc, request_timeout_s, request_id), request_id)
    policy.evospec_policy = True
    proxy.get_grpc_response_status = policy
