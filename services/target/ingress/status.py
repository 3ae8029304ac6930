"""Patches Serve's gRPC proxy's exception -> status mapping (`proxy.get_grpc_response_status`).

Serve 2.60's proxy turns a replica that died or became unreachable mid-request into INTERNAL, with the actor's id,
pid, name and namespace in the message. We want UNAVAILABLE "target restarting, retry" (the SDK retries it before
the first message) and no internals:
- a dead or unreachable replica (RayActorError) -> UNAVAILABLE "target restarting, retry";
- any other Ray-level error (RayTaskError: an exception our fronts did not map) -> INTERNAL "internal error
  (request <id>)"; the details stay in the proxy's log;
- every status our fronts set themselves (InvalidArgument, ResourceExhausted, ...) passes unchanged.
"""
from __future__ import annotations

import dataclasses
import logging

import grpc

from evospec.services.common.errors import INTERNAL_ERROR

log = logging.getLogger("ray.serve")

TARGET_RESTARTING = "target restarting, retry"


def public_status(exc: BaseException, status, request_id: str):
    """The status a client may see for `exc`, given the one Serve computed (a ResponseStatus)."""
    from ray.exceptions import RayActorError, RayTaskError
    original = getattr(exc, "original_exception", exc)  # Serve's gRPCStatusError wraps what a front raised
    if original is not exc and (status.code != grpc.StatusCode.INTERNAL or status.message.startswith(INTERNAL_ERROR)):
        return status  # a status our front set on purpose (its INTERNAL message names the id in our log)
    if isinstance(original, RayActorError) or isinstance(getattr(original, "cause", None), RayActorError):
        return dataclasses.replace(status, code=grpc.StatusCode.UNAVAILABLE, message=TARGET_RESTARTING)
    if isinstance(original, RayTaskError) or status.code == grpc.StatusCode.INTERNAL:
        return dataclasses.replace(status, code=grpc.StatusCode.INTERNAL,
                                   message=f"{INTERNAL_ERROR}{request_id}); see the server log")
    return status


def install_status_policy() -> None:
    """Wraps `proxy.get_grpc_response_status` with `public_status` (once)."""
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
