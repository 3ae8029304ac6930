"""What Serve's gRPC proxy accepts from clients and tells them when a target replica fails.

Serve 2.60's proxy turns a replica that died or became unreachable mid-request into INTERNAL, with the actor's id,
pid, name and namespace in the message. We want UNAVAILABLE "target restarting, retry" (the SDK retries it before
the first message) and no internals. Serve has no hook for this, so `install_error_policy` is registered as one of
the proxy's gRPC servicer functions (orchestration/app.py), which Serve imports and calls inside the proxy process
at start-up, and it wraps the proxy's status mapping there:

- a dead or unreachable replica (RayActorError) -> UNAVAILABLE "target restarting, retry";
- any other Ray-level error (RayTaskError: an exception our fronts did not map) -> INTERNAL "internal error
  (request <id>)"; the details stay in the proxy's log;
- every status our fronts set themselves (InvalidArgument, ResourceExhausted, ...) passes unchanged.

Optional TLS: with EVOSPEC_TLS_CERT and EVOSPEC_TLS_KEY (PEM file paths) in the proxy's environment, it adds a TLS
port (EVOSPEC_TLS_PORT, default 9443) to the proxy's server next to Serve's plaintext one (Serve has no TLS option).

It also makes the proxy hand undecodable requests to our front instead of failing them itself (grpc answers a
request that does not parse, e.g. a string field with invalid UTF-8, with UNKNOWN): the evospec.v1 methods get a
deserializer that returns an `UndecodableRequest` (also for requests over `max_request_bytes()`, unparsed), which the
gRPC front answers with INVALID_ARGUMENT. For that, `install_error_policy` must come first among the servicer
functions.

While no target replica runs (a restart after a kill, the ~20 s before a replacement is up), Serve's router holds a
new call until one does, i.e. until the client's deadline: the SDK's retry never applies. `_fail_fast_without_replicas`
makes the router give up on a call once it has seen no replica for `NO_REPLICA_GRACE_S`: gRPC UNAVAILABLE / HTTP 503
"target restarting, retry". Calls queued behind busy replicas are untouched (the replicas exist). A deployment that
scales to zero would need this off; ours never does (`num_replicas` >= 1).

And it answers Serve's own gRPC API (`ray.serve.RayServeAPIService`: ListApplications, Healthz) with
UNIMPLEMENTED on the public port, unless EVOSPEC_EXPOSE_SERVE_API=1 (`_hide_serve_api`).

If a Ray upgrade renames what it wraps, the policy logs a warning and leaves Serve's behaviour alone
(tests/e2e/test_chaos.py fails then).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from dataclasses import dataclass

import grpc

from evospec.services.common.errors import INTERNAL_ERROR

log = logging.getLogger("ray.serve")

TARGET_RESTARTING = "target restarting, retry"
PUBLIC_SERVICE = "evospec.v1.Generate"
MAX_REQUEST_BYTES_ENV = "EVOSPEC_MAX_REQUEST_BYTES"
EXPOSE_SERVE_API_ENV = "EVOSPEC_EXPOSE_SERVE_API"
TLS_CERT_ENV, TLS_KEY_ENV, TLS_PORT_ENV = "EVOSPEC_TLS_CERT", "EVOSPEC_TLS_KEY", "EVOSPEC_TLS_PORT"
DEFAULT_TLS_PORT = 9443
NO_REPLICA_GRACE_S = 0.5  # a router with no replica this long fails its waiting calls (the goal: within 1 s)
NO_REPLICA_POLL_S = 0.1
DEFAULT_MAX_REQUEST_BYTES = 16 << 20  # above any prompt that fits a 32k context (32768 x 256 bytes per token, 8 MiB)


def max_request_bytes() -> int:
    """The largest public request the proxy parses; the Target then applies the context-derived prompt limit."""
    return int(os.environ.get(MAX_REQUEST_BYTES_ENV, DEFAULT_MAX_REQUEST_BYTES))


@dataclass(frozen=True)
class UndecodableRequest:
    """Stands in for a request the proxy could not (or would not) parse; the front answers INVALID_ARGUMENT naming
    `field` (the whole request when no one field is to blame)."""
    reason: str
    field: str = "request"


def tolerant(deserialize, limit: int):
    """A request deserializer that never raises: too large or malformed input becomes an UndecodableRequest; a
    string field that is not UTF-8 is named (`chat.messages[1].content`)."""
    descriptor = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)  # Message.FromString's class

    def parse(data: bytes):
        if len(data) > limit:
            return UndecodableRequest(f"is {len(data)} bytes; this service accepts at most {limit}")
        try:
            return deserialize(data)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError and friends
            field = non_utf8_field(data, descriptor) if descriptor is not None else None
            if field is not None:
                return UndecodableRequest("is not valid UTF-8 (every string field must be)", field)
            return UndecodableRequest("is not a valid evospec.v1 message")
    return parse


def non_utf8_field(data: bytes, descriptor, prefix: str = "") -> str | None:
    """The path of the first string field in protobuf wire bytes `data` (a message of `descriptor`) whose bytes
    are not UTF-8 (repeated fields indexed: `chat.messages[1].content`), else None (also for bytes that are not a
    message at all: the caller then blames the whole request)."""
    seen: dict[int, int] = {}
    pos = 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire = key >> 3, key & 7
            if wire == 0:
                _, pos = _varint(data, pos)
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            elif wire == 2:
                length, pos = _varint(data, pos)
                chunk, pos = data[pos:pos + length], pos + length
                field = descriptor.fields_by_number.get(number)
                if field is None:
                    continue
                index = seen[number] = seen.get(number, -1) + 1
                name = prefix + field.name + (f"[{index}]" if field.is_repeated else "")
                if field.type == field.TYPE_STRING:
                    try:
                        chunk.decode("utf-8")
                    except UnicodeDecodeError:
                        return name
                elif field.type == field.TYPE_MESSAGE:
                    if (found := non_utf8_field(chunk, field.message_type, name + ".")) is not None:
                        return found
            else:
                return None
    except IndexError:
        return None
    return None


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise IndexError("varint too long")


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


def install_error_policy(servicer, server) -> None:
    """A Serve gRPC servicer function (called as `f(servicer, server)` in the proxy process) that registers no
    service: it wraps the proxy's exception -> status mapping with `public_status`, and the deserializers of the
    evospec.v1 methods registered after it with `tolerant`."""
    _install_tolerant_parsing(server)
    _install_tls(server)
    _hide_serve_api()
    _fail_fast_without_replicas()
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


def _install_tolerant_parsing(server) -> None:
    override = getattr(server, "_override_method_handler", None)
    if override is None or getattr(override, "evospec_policy", False):
        if override is None:
            log.warning("evospec: this Ray version's gRPC proxy cannot take tolerant request parsing")
        return
    limit = max_request_bytes()

    def tolerant_override(service_method: str, handler):
        handler = override(service_method, handler)
        if service_method.startswith(f"/{PUBLIC_SERVICE}/") and handler.request_deserializer is not None:
            handler = handler._replace(request_deserializer=tolerant(handler.request_deserializer, limit))
        return handler
    tolerant_override.evospec_policy = True
    server._override_method_handler = tolerant_override


def _hide_serve_api() -> None:
    """Serve's own gRPC API (`ray.serve.RayServeAPIService`: ListApplications names every application, Healthz)
    answers on the public port to anyone; Serve registers it before any servicer function and has no option to
    leave it out. Its two answers are replaced by UNIMPLEMENTED, as for any method the server lacks, unless the
    operator opts in with EVOSPEC_EXPOSE_SERVE_API=1. Health is `grpc.health.v1.Health` (Check, Watch, List)."""
    if os.environ.get(EXPOSE_SERVE_API_ENV) == "1":
        return
    try:
        from ray.serve._private.proxy import gRPCProxy
        from ray.serve._private.proxy_request_response import ResponseStatus
    except ImportError as exc:
        log.warning("evospec: cannot hide Serve's gRPC API on this Ray version: %s", exc)
        return
    if getattr(gRPCProxy.routes_response, "evospec_policy", False):
        return

    async def unimplemented(self, *, healthy: bool, message: str):
        yield ResponseStatus(code=grpc.StatusCode.UNIMPLEMENTED, message="Method not found!", is_error=True)
    unimplemented.evospec_policy = True
    gRPCProxy.routes_response = gRPCProxy.health_response = unimplemented


def _fail_fast_without_replicas() -> None:
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


def _install_tls(server) -> None:
    """A TLS port on the proxy's server when a certificate and key are configured (before the server starts)."""
    cert, key = os.environ.get(TLS_CERT_ENV), os.environ.get(TLS_KEY_ENV)
    if server is None or not (cert and key):
        return
    port = int(os.environ.get(TLS_PORT_ENV, DEFAULT_TLS_PORT))
    try:
        with open(key, "rb") as k, open(cert, "rb") as c:
            credentials = grpc.ssl_server_credentials([(k.read(), c.read())])
        server.add_secure_port(f"[::]:{port}", credentials)
    except Exception as exc:  # noqa: BLE001 - e.g. another proxy on this host holds the port: plaintext still works
        log.warning("evospec: no TLS port %d in this proxy: %s", port, exc)
        return
    log.info("evospec: TLS on port %d", port)
