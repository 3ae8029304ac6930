"""Patches the handlers Serve's gRPC proxy registers for each method (`server._override_method_handler`).

- The evospec.v1 methods get a deserializer that never raises (`tolerant`): grpc answers a request that does not
  parse (e.g. a string field with invalid UTF-8) with UNKNOWN by itself; instead, an `UndecodableRequest` (also for
  requests over `max_request_bytes()`, unparsed) reaches the gRPC front, which answers INVALID_ARGUMENT naming the
  field.
- grpc.health.v1 Check answers NOT_SERVING, with the reason in its trailing metadata (`evospec-health-reason`;
  an OK status carries no details), where the proxy would answer an error status because no target replica can
  take the call (a restart: UNAVAILABLE). A health checker asked "is it serving?" gets "no, and why", as the
  protocol intends, not a transport error.

Only handlers registered after `install_handler_policy` get this, so `install_error_policy` comes first among the
proxy's servicer functions.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2

from evospec.services.target.ingress.status import TARGET_RESTARTING

log = logging.getLogger("ray.serve")

PUBLIC_SERVICE = "evospec.v1.Generate"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_REASON_KEY = "evospec-health-reason"  # trailing metadata of a NOT_SERVING answer: why
MAX_REQUEST_BYTES_ENV = "EVOSPEC_MAX_REQUEST_BYTES"
DEFAULT_MAX_REQUEST_BYTES = 16 << 20  # above any prompt that fits a 32k context (32768 x 256 bytes per token, 8 MiB)


def max_request_bytes() -> int:
    """The largest public request the proxies parse; the Target then applies the context-derived prompt limit."""
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


def not_serving_while_unavailable(handler):
    """Serve's Health/Check handler, answering NOT_SERVING (status OK, the reason in the trailing metadata) where the
    proxy set UNAVAILABLE: no target replica could take the call. Every other outcome passes unchanged."""
    proxied = handler.unary_unary

    async def check(request, context):
        response = await proxied(request, context)
        if context.code() != grpc.StatusCode.UNAVAILABLE:
            return response
        details = context.details()
        reason = details.decode() if isinstance(details, bytes) else details
        reason = reason if reason and reason != "UNAVAILABLE" else TARGET_RESTARTING
        context.set_code(grpc.StatusCode.OK)
        context.set_details("")
        context.set_trailing_metadata((*(context.trailing_metadata() or ()), (HEALTH_REASON_KEY, reason)))
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING).SerializeToString()
    return handler._replace(unary_unary=check)


def policy_for(service_method: str, handler, limit: int):
    """The handler Serve built for `service_method`, with our parsing or health rule where one applies."""
    if service_method.startswith(f"/{PUBLIC_SERVICE}/") and handler.request_deserializer is not None:
        return handler._replace(request_deserializer=tolerant(handler.request_deserializer, limit))
    if service_method == HEALTH_CHECK and handler.unary_unary is not None:
        return not_serving_while_unavailable(handler)
    return handler


def install_handler_policy(server) -> None:
    """Wraps the proxy server's `_override_method_handler` with `policy_for` (once)."""
    override = getattr(server, "_override_method_handler", None)
    if override is None or getattr(override, "evospec_policy", False):
        if override is None and server is not None:
            log.warning("evospec: this Ray version's gRPC proxy cannot take our request parsing and health rule")
        return
    limit = max_request_bytes()

    def with_policy(service_method: str, handler):
        return policy_for(service_method, override(service_method, handler), limit)
    with_policy.evospec_policy = True
    server._override_method_handler = with_policy
