"""Bearer-token authentication for our gRPC servers and channels (docs/security.md).

Both APIs use the standard `authorization: Bearer <token>` metadata. The internal speculation stream checks it in a
server interceptor, before any handler runs, so an unauthenticated call never reaches the draft model; the public API
checks it in the Target deployment (Serve's proxy forwards the metadata), with the same `check_bearer`."""
from __future__ import annotations

from collections.abc import Iterable

import grpc

from evospec.errors import UnauthenticatedError
from evospec.services.common.bearer import check_bearer

AUTHORIZATION = "authorization"


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((AUTHORIZATION, f"Bearer {token}"),)


def authorization_of(metadata: Iterable[tuple[str, str]]) -> str | None:
    return next((value for key, value in metadata if key == AUTHORIZATION), None)


class BearerAuthInterceptor(grpc.ServerInterceptor):
    """Rejects every call without the shared secret with UNAUTHENTICATED before its handler runs."""

    def __init__(self, secret: str):
        self._tokens = (secret,)

    def intercept_service(self, continuation, handler_call_details):
        try:
            check_bearer(authorization_of(handler_call_details.invocation_metadata or ()), self._tokens)
        except UnauthenticatedError as exc:
            handler = continuation(handler_call_details)
            return None if handler is None else _denying(handler, str(exc))
        return continuation(handler_call_details)


def _denying(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that only aborts with UNAUTHENTICATED."""
    def deny(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
    kind = ("stream" if handler.request_streaming else "unary") + "_" + \
        ("stream" if handler.response_streaming else "unary")
    return getattr(grpc, f"{kind}_rpc_method_handler")(deny)


class _BearerClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                               grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the bearer metadata to every call of a channel."""

    def __init__(self, token: str):
        self._metadata = bearer_metadata(token)

    def _with_token(self, details):
        return details._replace(metadata=tuple(details.metadata or ()) + self._metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)


def authenticated_channel(address: str, token: str | None, options: list) -> grpc.Channel:
    """An insecure channel (the internal stream runs inside the cluster network) that sends `token` with every
    call; token None = no metadata."""
    channel = grpc.insecure_channel(address, options=options)
    return channel if token is None else grpc.intercept_channel(channel, _BearerClientInterceptor(token))
