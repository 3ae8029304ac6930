"""The SDK's retry rule against a plain gRPC server (no Ray): UNAVAILABLE is retried with backoff, unary calls whole
and streams only before their first message, all within one deadline per call; other errors are not retried."""
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from evospec_client import EvoSpecClient
from evospec_client.api.v1 import generate_pb2 as pb
from evospec_client.api.v1 import generate_pb2_grpc as pb_grpc
from evospec_client.errors import InvalidArgument, Unavailable


class Flaky(pb_grpc.GenerateServicer):
    """Answers UNAVAILABLE ('target restarting, retry') to the first `failures` calls of each method."""

    def __init__(self, failures: int, code=grpc.StatusCode.UNAVAILABLE, fail_midstream: bool = False):
        self.failures, self.code, self.fail_midstream = failures, code, fail_midstream
        self.calls = {"Info": 0, "Generate": 0}

    def _maybe_fail(self, method, context):
        self.calls[method] += 1
        if self.calls[method] <= self.failures:
            context.abort(self.code, "target restarting, retry")

    def Info(self, request, context):
        self._maybe_fail("Info", context)
        return pb.InfoResponse(version="x", max_model_len=4096, max_prompt_bytes=1 << 40)

    def Generate(self, request, context):
        if self.fail_midstream:
            self.calls["Generate"] += 1
            yield pb.GenerateResponse(token_ids=[1], text="a")
            context.abort(grpc.StatusCode.UNAVAILABLE, "target restarting, retry")
        self._maybe_fail("Generate", context)
        yield pb.GenerateResponse(token_ids=[1, 2], text="ab", finish_reason=pb.FINISH_REASON_LENGTH,
                                  stats=pb.SpecStats(steps=2, teacher_signal_bytes=3 << 33))


@pytest.fixture
def serve():
    servers = []

    def start(servicer):
        server = grpc.server(ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_GenerateServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return EvoSpecClient(f"127.0.0.1:{port}", timeout=10, retries=3, backoff_s=0.05)
    yield start
    for server in servers:
        server.stop(grace=None)


def test_unary_calls_are_retried_on_unavailable(serve):
    servicer = Flaky(failures=2)
    client = serve(servicer)
    assert client.info()["version"] == "x"
    assert servicer.calls["Info"] == 3


def test_info_and_stats_fields_keep_their_types(serve):
    """64-bit fields are ints, not protobuf JSON's strings (info() once gave max_prompt_bytes as "1099511627776")."""
    client = serve(Flaky(failures=0))
    info = client.info()
    assert info["max_prompt_bytes"] == 1 << 40 and info["max_model_len"] == 4096
    assert client.generate("hi").stats["teacher_signal_bytes"] == 3 << 33


def test_retries_stop_at_the_calls_deadline(serve):
    servicer = Flaky(failures=100)
    client = serve(servicer)
    client.backoff_s = 0.4
    start = time.monotonic()
    with pytest.raises(Unavailable, match="target restarting"):
        client._unary(client._stub.Info, pb.InfoRequest(), timeout=1.0)
    assert time.monotonic() - start < 1.5 and servicer.calls["Info"] == 2  # a third try would end past the deadline


def test_other_errors_are_not_retried(serve):
    servicer = Flaky(failures=1, code=grpc.StatusCode.INVALID_ARGUMENT)
    client = serve(servicer)
    with pytest.raises(InvalidArgument):
        client.info()
    assert servicer.calls["Info"] == 1


def test_a_stream_is_retried_only_before_its_first_message(serve):
    servicer = Flaky(failures=2)
    client = serve(servicer)
    assert client.generate("hi").token_ids == [1, 2] and servicer.calls["Generate"] == 3
    midstream = Flaky(failures=0, fail_midstream=True)
    client = serve(midstream)
    with pytest.raises(Unavailable):
        client.generate("hi")
    assert midstream.calls["Generate"] == 1  # a generation that started is never replayed
