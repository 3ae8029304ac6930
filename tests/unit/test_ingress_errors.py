"""What Serve's gRPC proxy tells a client when a target replica fails (services/target/ingress.py): a dead replica
is UNAVAILABLE "target restarting, retry", an unmapped error is INTERNAL without internals, and statuses our front
sets pass unchanged."""
import grpc
from ray.exceptions import ActorDiedError, RayTaskError
from ray.serve._private.grpc_util import get_grpc_response_status
from ray.serve.exceptions import gRPCStatusError

from evospec.errors import InvalidRequestError
from evospec.services.target.ingress import TARGET_RESTARTING, install_error_policy, public_status

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
    original = proxy.get_grpc_response_status
    try:
        install_error_policy(None, None)
        install_error_policy(None, None)
        patched = proxy.get_grpc_response_status
        assert patched is not original and getattr(patched, "evospec_policy", False)
        assert patched(ActorDiedError(), None, "r").code == grpc.StatusCode.UNAVAILABLE
    finally:
        proxy.get_grpc_response_status = original
