"""Property-based fuzzing of both protos (hypothesis), without Ray:

- the public API: the tiny pair's Target server behind the gRPC front, its draft behind the internal stream (with
  the shared secret), fed the `evospec fuzz` catalogue: every valid request completes, every invalid one is
  INVALID_ARGUMENT naming its field, raw bytes included (parsed as Serve's proxy does with our policy);
- the internal stream: arbitrary TargetStep sequences into the draft's SpeculateBatch handler: the stream never
  fails, every session error is a client error, and every session is freed when the stream ends;
- authentication: calls without the secret are UNAUTHENTICATED and never reach the draft model."""
import asyncio
import queue
import random
import time

import grpc
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from evospec.config import SchedulerConfig
from evospec.errors import UnauthenticatedError
from evospec.orchestration.fuzz import INVALID, RAW, Case, Limits, Outcome, finish_reason, make_case
from evospec.services.config import InternalStreamConfig, TargetServiceConfig
from evospec.services.draft.server import DraftServer, Op
from evospec.services.draft.servicer import DraftServicer, start_draft_server
from evospec.services.protocol.v1 import speculation_pb2 as spec_pb
from evospec.services.protocol.v1 import speculation_pb2_grpc as spec_grpc
from evospec.services.target.grpc_api import GrpcFront
from evospec.services.target.ingress import max_request_bytes, tolerant
from evospec.services.target.server import DraftSide, TargetServer
from evospec_client import build_request
from evospec_client.api.v1 import generate_pb2 as pb


class FakeContext:
    """What the gRPC front reads and sets on Serve's request context."""

    def __init__(self, metadata=()):
        self.metadata, self.code, self.details = tuple(metadata), None, ""

    def invocation_metadata(self):
        return self.metadata

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details

    def cancel(self):
        pass


@pytest.fixture(scope="module")
def service(tiny_draft_replica):
    draft, port, pool = tiny_draft_replica

    async def name():
        return "tiny"
    # Every request drafts its full tree at every step (no load-adaptive depth 0, no deferred draft prefill), so
    # each case exercises its shape. A 512-token context (the tiny pair's is 2048) keeps the cases that run to its
    # end short; every limit the tests use is read from Info.
    cfg = TargetServiceConfig(scheduler=SchedulerConfig(adaptive=False, draft_prefill="with_target"),
                              max_model_len=512)
    target = TargetServer.from_config(cfg, DraftSide(pool, name, name))
    info = asyncio.run(target.info())
    limits = Limits(info.max_model_len, info.static_vocab_size, info.max_prompt_bytes, max_tokens=4)
    yield GrpcFront(target), draft, port, limits
    target.close()


def call(front: GrpcFront, case: Case) -> Outcome:
    """One case through the front as Serve delivers it: raw bytes parsed by the proxy's tolerant deserializer."""
    request = case.request
    if isinstance(request, bytes):
        request = tolerant(pb.GenerateRequest.FromString, max_request_bytes())(request)
    context = FakeContext()
    try:
        reply = asyncio.run(asyncio.wait_for(front.GenerateOnce(request, context), timeout=60))
    except TimeoutError:
        return Outcome(case, "HANG", "")
    except Exception:  # noqa: BLE001 - the front set the status before raising
        return Outcome(case, context.code.name if context.code else "UNSET", context.details)
    return Outcome(case, "OK", "", len(reply.token_ids), finish_reason(reply))


@pytest.mark.fuzz
@given(seed=st.integers(0, 2**32 - 1))
def test_public_api_every_request_is_served_or_invalid_argument_naming_its_field(service, seed):
    front, draft, _, limits = service
    outcome = call(front, make_case(random.Random(seed), limits))
    assert outcome.ok, (outcome.case.name, outcome.code, outcome.details)


@pytest.mark.parametrize("name", sorted(INVALID))
def test_every_invalid_mutation_is_refused_naming_its_field(service, name):
    """Each catalogue entry at least once (the random cases may miss some), and nothing is left open after."""
    front, draft, _, limits = service
    rng = random.Random(name)
    case = make_case(rng, limits)
    while case.field is None or case.name != name:
        case = make_case(rng, limits)
    outcome = call(front, case)
    assert outcome.ok, (outcome.code, outcome.details)
    assert front.server.num_sessions() == 0


@pytest.mark.parametrize("name", sorted(RAW))
def test_undecodable_bytes_are_invalid_argument_naming_the_field(service, name):
    """Bytes that are not UTF-8 in any string field are INVALID_ARGUMENT naming that field (its index too); bytes
    that are no message at all name the request."""
    front, _, _, limits = service
    build, field = RAW[name]
    outcome = call(front, Case(name, build(random.Random(0), limits), field))
    assert outcome.ok, (outcome.code, outcome.details)
    assert outcome.details.startswith(f"{field}:"), outcome.details


def test_public_bearer_tokens(service, monkeypatch):
    front, _, _, limits = service
    request = pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(max_tokens=2))
    monkeypatch.setattr(front.server, "api_tokens", ("good-token",))
    for metadata in [(), (("authorization", "Bearer bad"),), (("authorization", "good-token"),)]:
        context = FakeContext(metadata)
        with pytest.raises(UnauthenticatedError):
            asyncio.run(front.GenerateOnce(request, context))
        assert context.code == grpc.StatusCode.UNAUTHENTICATED and "token" in context.details
    reply = asyncio.run(front.GenerateOnce(request, FakeContext((("authorization", "Bearer good-token"),))))
    assert len(reply.token_ids) == 2
    from evospec.services.config import PublicApiConfig
    from evospec.services.target.server import api_tokens
    monkeypatch.setenv("EVOSPEC_API_TOKENS", " a-token , ,")
    assert api_tokens(PublicApiConfig(auth_tokens=("", "b-token"))) == ("b-token", "a-token")  # never an empty one


def test_out_of_vocabulary_buffer_candidates_fail_their_session_as_invalid_argument(service):
    from evospec.config import SamplingParams, SpecParams
    from evospec.engine.drafter import DraftRequest
    from evospec.errors import InvalidRequestError
    from evospec.testing import wait_for
    from evospec.verify import VerifyResult
    _, draft, _, _ = service
    assert wait_for(lambda: draft.num_sessions() == 0, 10)  # earlier tests' sessions close after their replies
    for candidates in ({10**9: 1.0}, {5: float("nan")}):
        open_session(draft, "cand", DraftRequest([3, 4, 5], SamplingParams(), SpecParams(), 64, 0))
        step = draft.run_step([Op("cand", "outcome", result=VerifyResult([], [], 7), candidates=candidates)], {})
        assert isinstance(step["cand"].error, InvalidRequestError) and "buffer_candidates" in str(step["cand"].error)
        assert draft.num_sessions() == 0  # the failing op ended its session


def open_session(draft: DraftServer, key: str, request) -> None:
    """Open one session through the stream's entry point; its error, if any, raised."""
    error = draft.run_step([Op(key, "start", request)], {})[key].error
    if error is not None:
        raise error


# ---- the internal stream ---------------------------------------------------------------------------------------
ids = st.lists(st.integers(0, 2**32 - 1), max_size=6)
small_ids = st.lists(st.integers(0, 200), min_size=1, max_size=20)
starts = st.builds(
    spec_pb.StartSession, prompt_token_ids=st.one_of(small_ids, ids),
    sampling=st.builds(pb.SamplingParams, temperature=st.sampled_from([0.0, 0.7, -1.0, float("nan"), 1e-39]),
                       top_p=st.sampled_from([1.0, 0.9, 0.0]), top_k=st.integers(0, 10)),
    spec=st.builds(pb.SpecParams, method=st.sampled_from([0, 1, 2, 3, 4, 99]),
                   method_name=st.sampled_from(["", "sd", "frspec", "evospec", "ar", "x"]),
                   tree=st.builds(pb.TreeParams, shape=st.sampled_from([0, 1, 2, 9]),
                                  shape_name=st.sampled_from(["chain", "tree", "", "star"]),
                                  num_draft_tokens=st.integers(0, 70), depth=st.integers(0, 20),
                                  branching=st.integers(0, 20), budget=st.integers(0, 300)),
                   static_size=st.sampled_from([0, 1, 100, 32768, 10**6]),
                   dynamic_size=st.sampled_from([0, 8, 256, 10**6]),
                   retrieval=st.lists(st.sampled_from(["statistical", "semantic", "target", "bogus"]), max_size=3)),
    seed=st.integers(0, 2**64 - 1), max_len=st.sampled_from([0, 1, 30, 64, 200, 2100, 10**6, 2**32 - 1]))
outcomes = st.builds(spec_pb.Outcome, accepted_nodes=st.lists(st.integers(0, 20), max_size=4),
                     accepted_tokens=st.lists(st.integers(0, 2**32 - 1), max_size=4),
                     bonus_token=st.integers(0, 2**32 - 1),
                     buffer_candidates=st.lists(st.builds(spec_pb.BufferCandidate, token_id=st.integers(0, 2**32 - 1),
                                                          score=st.floats(allow_nan=True)), max_size=3))
session_ids = st.sampled_from(["a", "b", "c"])
ops = st.one_of(st.builds(spec_pb.SessionOp, session_id=session_ids, start=starts),
                st.builds(spec_pb.SessionOp, session_id=session_ids, outcome=outcomes),
                st.builds(spec_pb.SessionOp, session_id=session_ids, close=st.just(True)),
                st.builds(spec_pb.SessionOp, session_id=session_ids))  # no op set
steps = st.builds(spec_pb.TargetStep, ops=st.lists(ops, max_size=4),
                  work=st.lists(st.builds(spec_pb.DraftWork, session_id=session_ids, depth=st.integers(0, 20),
                                          prefill_tokens=st.integers(0, 3000)), max_size=3))
CLIENT_ERRORS = {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}


@pytest.mark.fuzz
@given(messages=st.lists(steps, min_size=1, max_size=6))
def test_internal_stream_survives_any_message_sequence(service, messages):
    _, draft, _, _ = service
    servicer = DraftServicer(draft, InternalStreamConfig(max_sessions_per_stream=2))
    context = FakeContext()
    replies = list(servicer.SpeculateBatch(iter(messages), context))
    assert context.code is None, context.details  # the stream itself never fails
    assert len(replies) == len(messages)
    for reply in replies:
        for session in reply.sessions:
            assert not session.error or session.error_code in CLIENT_ERRORS, (session.error_code, session.error)
    assert draft.num_sessions() == 0  # every exit path frees its sessions


def test_internal_calls_without_the_secret_never_reach_the_draft(service, monkeypatch):
    _, draft, port, _ = service
    touched = []
    monkeypatch.setattr(draft, "run_step", lambda *a, **k: touched.append(a))
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    start = spec_pb.SessionOp(session_id="x", start=spec_pb.StartSession(prompt_token_ids=[1, 2], max_len=64))
    for metadata in [(), (("authorization", "Bearer wrong-secret-0123456789"),)]:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.RpcError) as err:
                list(spec_grpc.DraftStub(channel).SpeculateBatch(iter([spec_pb.TargetStep(ops=[start])]),
                                                                 metadata=metadata, timeout=10))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), metadata=metadata,
                                                          timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert touched == [] and draft.num_sessions() == 0


def test_streams_beyond_the_limit_are_refused_and_idle_ones_closed():
    """max_streams caps concurrent calls (RESOURCE_EXHAUSTED past it); a stream silent for idle_timeout_s is
    closed and its sessions freed."""
    from evospec.config import SamplingParams, SpecParams
    from evospec.engine.draft import DraftEngine
    from evospec.engine.drafter import DraftRequest
    from evospec.services.common.convert import session_op_to_proto
    from evospec.testing import random_pair
    from evospec.vocab.registry import VocabPolicies
    _, model = random_pair(vocab=96, seed=1)
    draft = DraftServer(DraftEngine(model), VocabPolicies(model.head_weight, torch.arange(32)), "sha")
    limits = InternalStreamConfig(max_streams=2, idle_timeout_s=1.0)
    grpc_server, port = start_draft_server(draft, "127.0.0.1", limits)
    start = session_op_to_proto("s", "start", DraftRequest([3, 4, 5], SamplingParams(), SpecParams(method="sd"), 64, 0))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = spec_grpc.DraftStub(channel)
            outboxes = [queue.Queue() for _ in range(2)]  # each stream sends one step, then nothing (kept open)
            for outbox in outboxes:
                outbox.put(spec_pb.TargetStep(ops=[start]))
            held = [stub.SpeculateBatch(iter(outbox.get, None), timeout=30) for outbox in outboxes]
            first = [next(call) for call in held]
            assert all(not s.error for reply in first for s in reply.sessions), first
            with pytest.raises(grpc.RpcError) as err:
                list(stub.SpeculateBatch(iter([spec_pb.TargetStep()]), timeout=10))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            deadline = time.monotonic() + 10
            while draft.num_sessions() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert draft.num_sessions() == 0  # the idle watch closed both streams
            for outbox in outboxes:
                outbox.put(None)
    finally:
        grpc_server.stop(grace=None)


def test_draft_kv_memory_and_policy_cache_are_bounded():
    """Sizes a caller chooses cannot grow the draft past its configured bounds: sessions' KV slots are counted
    against max_kv_tokens (RESOURCE_EXHAUSTED past it, freed on close), max_len is capped by the context, and
    vocabulary policies for many distinct static sizes stay within the cache's byte bound."""
    from evospec.config import SamplingParams, SpecParams
    from evospec.engine.draft import DraftEngine
    from evospec.engine.drafter import DraftRequest
    from evospec.errors import InvalidRequestError, OverloadedError
    from evospec.testing import random_pair
    from evospec.vocab.registry import VocabPolicies
    _, model = random_pair(vocab=96, seed=1)
    policies = VocabPolicies(model.head_weight, torch.arange(64), max_cache_bytes=40 * 32 * 4)  # ~40 head rows
    draft = DraftServer(DraftEngine(model), policies, "sha", max_kv_tokens=300)
    request = DraftRequest([3, 4, 5], SamplingParams(), SpecParams(method="sd"), 100, 0)
    open_session(draft, "a", request)
    open_session(draft, "b", request)
    with pytest.raises(OverloadedError):
        open_session(draft, "c", request)
    draft.close("a")
    open_session(draft, "c", request)  # the closed session's slots came back
    with pytest.raises(InvalidRequestError, match="max_len"):
        open_session(draft, "d", DraftRequest([3], SamplingParams(), SpecParams(method="sd"), 10**6, 0))
    for size in range(1, 40):  # each fits the bound alone (the newest policy is always kept)
        policies.get(SpecParams(method="frspec", vocab={"static_size": size, "dynamic_size": 0}))
    assert policies.cache_bytes() <= policies.max_cache_bytes
    for key in ("b", "c"):
        draft.close(key)
    assert draft.num_sessions() == 0 and draft._kv_tokens == 0


@pytest.mark.parametrize("tree", [{"shape": "tree", "depth": 16, "branching": 16, "budget": 8},
                                  {"shape": "tree", "depth": 16, "branching": 16, "budget": 1},
                                  {"shape": "chain", "num_draft_tokens": 64}])
@pytest.mark.slow
def test_extreme_tree_shapes_run_to_the_end_of_the_context(service, tree):
    """Trees that forward far more nodes than they keep (greedy pruning) once overflowed the draft's cache near the
    end of a generation: run them to the last token the context allows, through the service path, and compare with
    the target alone."""
    front, _, _, limits = service
    max_tokens = 24
    prompt = [100 + i % 500 for i in range(limits.max_model_len - max_tokens - 1)]  # ends at the context's last slot

    def run(method):
        request = build_request(prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, method=method,
                                tree=tree)
        return asyncio.run(front.GenerateOnce(request, FakeContext()))
    reference, reply = run("ar"), run("evospec")
    assert list(reply.token_ids) == list(reference.token_ids) and len(reply.token_ids) == max_tokens
    stats = reply.stats
    assert stats.fallback_steps == 0 and stats.drafted >= stats.steps - 1  # a tree at every step but the prefill
