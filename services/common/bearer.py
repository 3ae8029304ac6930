"""The bearer-token check shared by every front (gRPC metadata or an HTTP header carry the same value); no gRPC
here, so the transport-free target server can use it."""
from __future__ import annotations

import hmac
from collections.abc import Iterable

from evospec.errors import UnauthenticatedError


def check_bearer(authorization: str | None, tokens: Iterable[str]) -> None:
    """Raise UnauthenticatedError unless `authorization` is 'Bearer <t>' for one of `tokens`."""
    if authorization is None:
        raise UnauthenticatedError("send the metadata 'authorization: Bearer <token>'")
    scheme, _, token = authorization.partition(" ")
    ok = False
    for accepted in tokens:  # no early exit: the time taken does not tell which token nearly matched
        ok |= hmac.compare_digest(token.encode(), accepted.encode())
    if scheme.lower() != "bearer" or not token or not ok:
        raise UnauthenticatedError("the bearer token is not valid")
