"""What Serve's gRPC proxy tells a client when a target replica fails (services/target/ingress.py): a dead replica
is UNAVAILABLE "target restarting, retry", an unmapped error is INTERNAL without internals, and statuses our front
sets pass unchanged."""
import asyncio
import time
import types

import grpc
import pytest
from ray.exceptions import ActorDiedError, RayTaskError
from ray.serve._private.grpc_util import get_grpc_response_status
from ray.serve.exceptions import DeploymentUnavailableError, gRPCStatusError

from evospec.errors import InvalidRequestError
from evospec.services.target.ingress import (
    HEALTH_REASON_KEY,
    TARGET_RESTARTING,
    fail_fast_without_replicas,
    install_error_policy,
    not_serving_while_unavailable,
    public_status,
    until_done_or_no_replicas,
)

INTERNALS = ("actor", "pid", "namespace", "Traceback", "ray::")


def status_for(exc):
    return public_status(exc, get_grpc_response_status(exc, None, "req-1"), "req-1")


def test_a_dead_replica_is_unavailable_without_internals():
    died = ActorDiedError()
    assert get_grpc_response_status(died, None, "req-1").code == grpc.StatusCode.INTERNAL  # what Serve answers
    status = status_for(died)
    assert status.code == grpc.StatusCode.UNAVAILABLE and status.message == TARGET_RESTARTING


def test_an_unmapped_error_is_internal_without_internals():
    try:
        raise ValueError("secret detail at /home/replica/model.py")
    except ValueError as exc:
        task_error = RayTaskError("Generate", "Traceback ... ray::ServeReplica pid=123", exc)
    status = status_for(task_error)
    assert status.code == grpc.StatusCode.INTERNAL and "req-1" in status.message
    assert not any(word in status.message for word in (*INTERNALS, "secret"))


def test_statuses_set_by_our_front_pass_unchanged():
    exc = gRPCStatusError(InvalidRequestError("max_tokens", "must be >= 1"), grpc.StatusCode.INVALID_ARGUMENT,
                          "max_tokens: must be >= 1")
    status = status_for(exc)
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT and status.message == "max_tokens: must be >= 1"


def test_an_internal_error_our_front_reported_keeps_the_id_of_our_log():
    from evospec.services.common.errors import public_details
    message = public_details(RuntimeError("secret detail"), "our-id")
    exc = gRPCStatusError(RuntimeError("secret detail"), grpc.StatusCode.INTERNAL, message)
    status = status_for(exc)
    assert status.code == grpc.StatusCode.INTERNAL and "our-id" in status.message and "secret" not in status.message


def test_the_policy_installs_once_in_the_proxy_module():
    from ray.serve._private import proxy
    from ray.serve._private.router import AsyncioRouter
    original, route = proxy.get_grpc_response_status, AsyncioRouter.route_and_send_request
    try:
        install_error_policy(None, None)
        install_error_policy(None, None)
        patched = proxy.get_grpc_response_status
        assert patched is not original and getattr(patched, "evospec_policy", False)
        assert patched(ActorDiedError(), None, "r").code == grpc.StatusCode.UNAVAILABLE
    finally:
        proxy.get_grpc_response_status = original
        AsyncioRouter.route_and_send_request = route


class FakeRouter:
    """What the wrapped `route_and_send_request` reads of Serve's AsyncioRouter."""
    def __init__(self, replicas):
        self.request_router = types.SimpleNamespace(curr_replicas=replicas)
        self.deployment_id = "Target"


def router_that_waits(monkeypatch, wait_s: float):
    """Serve's router with the fail-fast policy, over a stand-in for Serve's routing that takes `wait_s` (a replica
    busy, or none coming back) and records whether it was cancelled."""
    from ray.serve._private.router import AsyncioRouter
    seen = {"cancelled": False}

    async def route(self, pending_request, response_id):
        try:
            await asyncio.sleep(wait_s)
        except asyncio.CancelledError:
            seen["cancelled"] = True
            raise
        return "replica-1"
    monkeypatch.setattr(AsyncioRouter, "route_and_send_request", route)
    fail_fast_without_replicas()
    return AsyncioRouter.route_and_send_request, seen


def test_a_call_without_any_replica_fails_unavailable_within_a_second(monkeypatch):
    choose, seen = router_that_waits(monkeypatch, wait_s=30)

    async def call():
        try:
            await choose(FakeRouter({}), None, "id")
        finally:
            await asyncio.sleep(0)  # let the withdrawn routing task see its cancellation
            seen["cancelled_before_return"] = seen["cancelled"]
    start = time.monotonic()
    with pytest.raises(DeploymentUnavailableError) as failed:
        asyncio.run(call())
    assert time.monotonic() - start < 1.0
    assert seen["cancelled_before_return"]  # Serve's routing is withdrawn: the call leaves its queue
    status = status_for(failed.value)
    assert (status.code, status.message) == (grpc.StatusCode.UNAVAILABLE, TARGET_RESTARTING)
    from ray.serve._private.http_util import get_http_response_status
    http = get_http_response_status(failed.value, None, "req-1")
    assert (http.code, http.message) == (503, TARGET_RESTARTING)  # what Serve's HTTP proxy answers


def test_a_call_queued_behind_busy_replicas_is_not_failed(monkeypatch):
    choose, seen = router_that_waits(monkeypatch, wait_s=1.2)  # longer than the grace
    assert asyncio.run(choose(FakeRouter({"r1": object()}), None, "id")) == "replica-1"
    assert not seen["cancelled"]


def test_a_caller_giving_up_withdraws_the_routing(monkeypatch):
    choose, seen = router_that_waits(monkeypatch, wait_s=30)

    async def give_up():
        call = asyncio.ensure_future(choose(FakeRouter({"r1": object()}), None, "id"))
        await asyncio.sleep(0.2)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.sleep(0)
        return seen["cancelled"]
    assert asyncio.run(give_up())


def test_a_router_not_yet_configured_is_not_failed(monkeypatch):
    """Before Serve tells a new router its deployment's config, it has no request router: that is not a restart."""
    choose, seen = router_that_waits(monkeypatch, wait_s=1.2)
    router = FakeRouter({})
    router.request_router = None
    assert asyncio.run(choose(router, None, "id")) == "replica-1"
    assert not seen["cancelled"]


def test_a_replica_back_within_the_grace_takes_the_call():
    async def scenario():
        replicas: dict = {}
        choosing = asyncio.ensure_future(asyncio.sleep(0.6, result="replica-2"))
        asyncio.get_running_loop().call_later(0.3, replicas.update, {"r2": object()})
        await until_done_or_no_replicas(choosing, lambda: not replicas, grace_s=0.5, poll_s=0.05)
        return choosing.done() and choosing.result()
    assert asyncio.run(scenario()) == "replica-2"


def serve_check(proxied) -> tuple:
    """grpc.health.v1 Check served by a real gRPC aio server whose handler is Serve's (here `proxied`, raw bytes in
    and out, as the proxy's are) wrapped by our rule; returns (status, reason) as a health client sees them."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async def scenario():
        handler = grpc.unary_unary_rpc_method_handler(proxied)  # no (de)serializers: bytes, as in Serve's proxy
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "grpc.health.v1.Health", {"Check": not_serving_while_unavailable(handler)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                reply = await call
                trailers = dict(await call.trailing_metadata())
                return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status), trailers.get(HEALTH_REASON_KEY)
        finally:
            await server.stop(None)
    return asyncio.run(scenario())


def test_health_check_during_a_restart_is_not_serving_with_its_reason():
    """What Serve's proxy answers while no target replica runs (UNAVAILABLE, sometimes with the bare text
    "UNAVAILABLE") reaches a health checker as NOT_SERVING with a reason, not as a transport error."""
    for details, reason in ((TARGET_RESTARTING, TARGET_RESTARTING), ("UNAVAILABLE", TARGET_RESTARTING),
                            ("", TARGET_RESTARTING), ("draining", "draining")):
        async def restarting(request, context, details=details):
            context.set_code(grpc.StatusCode.UNAVAILABLE)
            context.set_details(details)
            return b""
        assert serve_check(restarting) == ("NOT_SERVING", reason)


def test_health_check_answers_of_a_replica_pass_unchanged():
    from grpc_health.v1 import health_pb2

    async def serving(request, context):
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING).SerializeToString()
    assert serve_check(serving)[0] == "SERVING"

    async def unknown(request, context):
        context.set_code(grpc.StatusCode.NOT_FOUND)
        return b""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        serve_check(unknown)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
