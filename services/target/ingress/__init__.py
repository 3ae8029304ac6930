"""What Serve's proxies accept from clients and tell them when a target replica fails: our policy inside Serve.

Serve has no hooks for any of this, so `install_error_policy` is registered as the first of the gRPC proxy's
servicer functions (orchestration/app.py), which Serve imports and calls inside the proxy process at start-up (and
which registers no service itself). Each module patches one thing of Serve's, and says what and why:

- `status.py`: the proxy's exception -> gRPC status mapping. A dead or unreachable replica is UNAVAILABLE "target
  restarting, retry" (the SDK retries it before the first message), any other Ray-level error INTERNAL with a request
  id only; statuses our fronts set pass unchanged. No actor ids, pids or namespaces reach a client.
- `handlers.py`: the proxy's per-method handlers. The evospec.v1 methods get a deserializer that never fails
  (undecodable or over-`max_request_bytes()` requests reach our front, which answers INVALID_ARGUMENT naming the
  field), and grpc.health.v1 Check answers NOT_SERVING with its reason while no target replica can answer (instead
  of an error status). This is why `install_error_policy` must come first among the servicer functions.
- `fail_fast.py`: Serve's router. While no target replica runs (a restart), a waiting call fails with UNAVAILABLE
  after NO_REPLICA_GRACE_S instead of at the client's deadline.
- `serve_api.py`: Serve's own gRPC API (ListApplications, Healthz) answers UNIMPLEMENTED on the public port unless
  EVOSPEC_EXPOSE_SERVE_API=1.
- `tls.py`: an optional TLS port (EVOSPEC_TLS_CERT / EVOSPEC_TLS_KEY / EVOSPEC_TLS_PORT) beside Serve's plaintext one.

If a Ray upgrade renames what a patch wraps, it logs a warning and leaves Serve's behaviour alone
(tests/unit/test_ingress_errors.py and tests/e2e/test_chaos.py fail then).
"""
from __future__ import annotations

from evospec.services.target.ingress.fail_fast import (
    NO_REPLICA_GRACE_S,
    fail_fast_without_replicas,
    until_done_or_no_replicas,
)
from evospec.services.target.ingress.handlers import (
    HEALTH_REASON_KEY,
    MAX_REQUEST_BYTES_ENV,
    UndecodableRequest,
    install_handler_policy,
    max_request_bytes,
    not_serving_while_unavailable,
    tolerant,
)
from evospec.services.target.ingress.serve_api import EXPOSE_SERVE_API_ENV, hide_serve_api
from evospec.services.target.ingress.status import TARGET_RESTARTING, install_status_policy, public_status
from evospec.services.target.ingress.tls import TLS_CERT_ENV, TLS_KEY_ENV, TLS_PORT_ENV, install_tls

__all__ = ["EXPOSE_SERVE_API_ENV", "HEALTH_REASON_KEY", "MAX_REQUEST_BYTES_ENV", "NO_REPLICA_GRACE_S",
           "TARGET_RESTARTING", "TLS_CERT_ENV", "TLS_KEY_ENV", "TLS_PORT_ENV", "UndecodableRequest",
           "fail_fast_without_replicas", "install_error_policy", "max_request_bytes", "not_serving_while_unavailable",
           "public_status", "tolerant", "until_done_or_no_replicas"]


def install_error_policy(servicer, server) -> None:
    """A Serve gRPC servicer function (called as `f(servicer, server)` in the proxy process) that registers no
    service: it installs each patch of this package once."""
    install_handler_policy(server)
    install_tls(server)
    hide_serve_api()
    fail_fast_without_replicas()
    install_status_policy()
