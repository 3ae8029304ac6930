"""Patches Serve's router (`AsyncioRouter.route_and_send_request`) so calls fail fast while no target replica runs.

While no target replica runs (a restart after a kill, the ~20 s before a replacement is up), Serve's router holds a
new call until one does, i.e. until the client's deadline: the SDK's retry never applies. The wrapped router gives up
on a call once it has seen no replica for `NO_REPLICA_GRACE_S`: gRPC UNAVAILABLE / HTTP 503 "target restarting,
retry". Calls queued behind busy replicas are untouched (the replicas exist). A deployment that scales to zero would
need this off; ours never does (`num_replicas` >= 1).
"""
from __future__ import annotations

import asyncio
import logging
import time

from evospec.services.target.ingress.status import TARGET_RESTARTING

log = logging.getLogger("ray.serve")

NO_REPLICA_GRACE_S = 0.5  # a router with no replica this long fails its waiting calls (the goal: within 1 s)
NO_REPLICA_POLL_S = 0.1


def fail_fast_without_replicas() -> None:
    """Wraps the proxy's router so a call waiting for a replica fails with UNAVAILABLE once the router has known no
    replica for NO_REPLICA_GRACE_S (see the module's docstring). It wraps `AsyncioRouter.route_and_send_request`
    (choose a replica, send): the request-router class itself reaches the proxy pickled by value from the
    controller, so a patch of Serve's RequestRouter there would not apply."""
    try:
        from ray.serve._private.router import AsyncioRouter
        from ray.serve.exceptions import DeploymentUnavailableError
    except ImportError as exc:
        log.warning("evospec: cannot fail calls fast during a restart on this Ray version: %s", exc)
        return
    original = AsyncioRouter.route_and_send_request
    if getattr(original, "evospec_policy", False):
        return

    class TargetRestarting(DeploymentUnavailableError):
        """Serve's proxies answer this error with gRPC UNAVAILABLE / HTTP 503 and its message."""
        @property
        def message(self) -> str:
            return TARGET_RESTARTING

    def has_no_replica(router) -> bool:
        try:
            request_router = router.request_router  # None until Serve has told the router its deployment's config
            return request_router is not None and len(request_router.curr_replicas) == 0
        except Exception:  # noqa: BLE001 - a Ray upgrade renamed something: wait as Serve does
            return False

    async def route_or_fail(self, pending_request, response_id):
        routing = asyncio.ensure_future(original(self, pending_request, response_id))
        try:
            await until_done_or_no_replicas(routing, lambda: has_no_replica(self))
        except asyncio.CancelledError:  # the caller gave up: withdraw the routing, or the request it already sent
            if routing.done() and not routing.cancelled() and routing.exception() is None:
                routing.result().cancel()
            routing.cancel()
            raise
        if not routing.done():
            routing.cancel()
            log.warning("evospec: no %s replica for %.1f s: a waiting call fails with UNAVAILABLE",
                        self.deployment_id, NO_REPLICA_GRACE_S)
            raise TargetRestarting(self.deployment_id)
        return routing.result()
    route_or_fail.evospec_policy = True
    AsyncioRouter.route_and_send_request = route_or_fail
    log.info("evospec: calls fail fast (UNAVAILABLE) once a router has had no replica for %.1f s",
             NO_REPLICA_GRACE_S)


async def until_done_or_no_replicas(task: asyncio.Future, has_no_replica, grace_s: float = NO_REPLICA_GRACE_S,
                                    poll_s: float = NO_REPLICA_POLL_S) -> None:
    """Returns when `task` is done, or once `has_no_replica()` has held for `grace_s` (the task still running)."""
    empty_since = None
    while True:
        if has_no_replica():
            empty_since = time.monotonic() if empty_since is None else empty_since
            if time.monotonic() - empty_since >= grace_s:
                return
        else:
            empty_since = None
        done, _ = await asyncio.wait({task}, timeout=poll_s)
        if done:
            return


