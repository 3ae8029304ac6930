"""EvoSpec Serve client SDK (sync and async)."""
from evospec_client.errors import (
                           Cancelled,
                           DeadlineExceeded,
                           EvoSpecClientError,
                           InternalError,
                           InvalidArgument,
                           NotFound,
                           ResourceExhausted,
                           Unauthenticated,
                           Unavailable,
)
from evospec_client.sdk import AsyncEvoSpecClient, Completion, Delta, EvoSpecClient, build_request

__all__ = ["AsyncEvoSpecClient", "Cancelled", "Completion", "DeadlineExceeded", "Delta", "EvoSpecClient",
           "EvoSpecClientError", "InternalError", "InvalidArgument", "NotFound", "ResourceExhausted", "Unauthenticated",
           "Unavailable",
           "build_request"]
