"""The exposed surface of the running service (docs/security.md): reflection lists only our services, the HTTP port
answers a clear 404, malformed bytes through Serve's real proxy are INVALID_ARGUMENT, the draft's internal stream
refuses callers without the application's secret, and the optional TLS port serves the same API."""
import json
import random
import urllib.error
import urllib.request

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from evospec.orchestration.fuzz import RAW, Case, limits_of, send

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
METADATA = (("application", "evospec"),)


def test_reflection_lists_only_our_services(service):
    with grpc.insecure_channel(service[0]) as channel:
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert names == {"evospec.v1.Generate", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}


def test_the_http_port_answers_404_not_500(service):
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"http://127.0.0.1:{service[1].http_port}/", timeout=30)
    assert err.value.code == 404  # OpenAI's error JSON, naming the routes there are (docs/openai.md)
    assert "/v1/chat/completions" in json.loads(err.value.read())["error"]["message"]


@pytest.mark.parametrize("name", sorted(RAW))
def test_malformed_bytes_through_the_proxy_are_invalid_argument(service, client, name):
    limits = limits_of(client.info())
    with grpc.insecure_channel(service[0]) as channel:
        for stream in (False, True):
            build, field = RAW[name]
            outcome = send(channel, Case(name, build(random.Random(1), limits), field), METADATA, 60, stream)
            assert outcome.ok, (outcome.code, outcome.details)


def test_the_internal_stream_refuses_callers_without_the_secret(service, client):
    from ray import serve

    from evospec.services.protocol.v1 import speculation_pb2 as spec_pb
    from evospec.services.protocol.v1 import speculation_pb2_grpc as spec_grpc
    address = serve.get_deployment_handle("Draft", "evospec").address.remote().result(timeout_s=30)
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            list(spec_grpc.DraftStub(channel).SpeculateBatch(iter([spec_pb.TargetStep()]), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert ray.is_initialized()
    assert client.generate(prompt="Hello", max_tokens=4, method="evospec").stats["fallback_steps"] == 0


def test_tls_port_serves_the_same_api(service, tls_files):
    from pathlib import Path

    from evospec_client import EvoSpecClient
    root = Path(tls_files["cert"]).read_bytes()
    with EvoSpecClient(f"127.0.0.1:{tls_files['port']}", tls_root_cert=root, timeout=60) as tls_client:
        out = tls_client.generate(prompt="Hello", max_tokens=4, method="ar")
    assert len(out.token_ids) == 4


def test_health_watch_and_list_answer_on_the_public_port(service):
    """grpc.health.v1 Watch streams the status (SERVING now), List names every service; load balancers use both."""
    with grpc.insecure_channel(service[0]) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service="evospec.v1.Generate"), timeout=10,
                           metadata=METADATA)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        unknown = stub.Watch(health_pb2.HealthCheckRequest(service="nope"), timeout=10, metadata=METADATA)
        assert next(unknown).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        unknown.cancel()
        listed = stub.List(health_pb2.HealthListRequest(), timeout=10, metadata=METADATA)
        assert {name: s.status for name, s in listed.statuses.items()} == {
            "": health_pb2.HealthCheckResponse.SERVING, "evospec.v1.Generate": health_pb2.HealthCheckResponse.SERVING}


@pytest.mark.parametrize("method", ["ListApplications", "Healthz"])
def test_serve_own_grpc_api_is_not_on_the_public_port(service, method):
    """Serve's RayServeAPIService (application names, its own health) is UNIMPLEMENTED to clients, with or without
    the application metadata (EVOSPEC_EXPOSE_SERVE_API=1 would opt in)."""
    with grpc.insecure_channel(service[0]) as channel:
        call = channel.unary_unary(f"/ray.serve.RayServeAPIService/{method}", request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
        for metadata in ((), METADATA):
            with pytest.raises(grpc.RpcError) as err:
                call(b"", timeout=10, metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED, err.value.details()
