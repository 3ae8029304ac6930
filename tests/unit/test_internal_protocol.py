"""The draft<->target stream on a plain gRPC server (no Ray): a generation whose draft runs behind the stream is
identical to the in-process one (greedy and seeded sampling), including EvoSpec buffer updates and misses; and the
transport-free TargetServer streams the same tokens and statistics as typed events."""
import asyncio
import time

import pytest
import torch

from evospec.config import SamplingParams, SchedulerConfig, SpecParams, TreeParams
from evospec.engine.draft import DraftEngine
from evospec.engine.generate import SpeculativeDecoder
from evospec.engine.scheduler import Scheduler
from evospec.services.draft.server import DraftServer
from evospec.services.draft.servicer import start_draft_server
from evospec.services.target.remote_draft import DraftStreamError, RemoteDraftPool, RemoteMuxDrafter
from evospec.services.target.server import DraftSide, FinishedEvent, GenerateRequest, Prompt, TargetServer
from evospec.testing import RandomDepth, random_pair
from evospec.vocab.registry import VocabPolicies

VOCAB = 96
STATIC = torch.arange(0, VOCAB, 3)  # 32 ids: many misses, so the buffer works
COUNTED = ("steps", "drafted", "accepted", "accepted_per_pos", "generated_tokens", "misses", "verified_positions",
           "buffer_updates")


def pool_for(address: str) -> RemoteDraftPool:
    async def resolve() -> str:
        return address
    pool = RemoteDraftPool(resolve, timeout_s=30)
    asyncio.run(pool.connect())
    return pool


@pytest.fixture(scope="module")
def setup():
    target, draft = random_pair(vocab=VOCAB, seed=9, eos=1)
    local = SpeculativeDecoder(target, draft, static_ids=STATIC)
    draft_server = DraftServer(DraftEngine(draft), VocabPolicies(draft.head_weight, STATIC), "sha")
    grpc_server, port = start_draft_server(draft_server, "127.0.0.1")
    pool = pool_for(f"127.0.0.1:{port}")
    remote_only = SpeculativeDecoder(target, None, static_ids=STATIC)
    yield local, remote_only, pool, draft_server, port
    pool.close()
    grpc_server.stop(grace=None)


def remote_factory(pool: RemoteDraftPool, decoder: SpeculativeDecoder, session_id: str = "req-1", sha: str = "sha"):
    return lambda request: pool.open(session_id, request, decoder.policies.layout(request.spec), VOCAB, sha)


def wait_closed(draft_server: DraftServer) -> None:
    deadline = time.monotonic() + 10  # the draft frees the session when it sees the stream end (asynchronously)
    while draft_server.num_sessions() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert draft_server.num_sessions() == 0


CASES = [
    ("sd", SamplingParams(max_tokens=40, ignore_eos=True)),
    ("frspec", SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, top_p=0.9, seed=3)),
    ("evospec", SamplingParams(max_tokens=40, ignore_eos=True)),
    ("evospec", SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, seed=5)),
]


@pytest.mark.parametrize("method,sampling", CASES, ids=[f"{m}-T{s.temperature}" for m, s in CASES])
@pytest.mark.parametrize("tree", [TreeParams(shape="chain", num_draft_tokens=3),
                                  TreeParams(shape="tree", depth=3, branching=2, budget=7)], ids=["chain", "tree"])
def test_remote_equals_local(setup, method, sampling, tree):
    local, remote_only, pool, draft_server, _ = setup
    spec = SpecParams(method=method, tree=tree, vocab={"static_size": 32, "dynamic_size": 8})
    a = local.generate([4, 50, 51, 7], sampling, spec)
    b = remote_only.generate([4, 50, 51, 7], sampling, spec, drafter_factory=remote_factory(pool, remote_only))
    list(a), list(b)
    assert b.output_ids == a.output_ids
    for key in COUNTED:
        assert getattr(b.stats, key) == getattr(a.stats, key), key
    assert b.stats.draft_head_seconds > 0  # measured on the draft side, reported over the stream
    if method == "evospec":
        assert b.stats.buffer_update_seconds > 0
    wait_closed(draft_server)


def test_mismatched_static_vocabulary_is_refused(setup):
    _, remote_only, pool, draft_server, _ = setup
    gen = remote_only.generate([4, 5], SamplingParams(max_tokens=4),
                               SpecParams(method="frspec", vocab={"static_size": 32}),
                               drafter_factory=remote_factory(pool, remote_only, "req-2", sha="other"))
    with pytest.raises(DraftStreamError, match="different static vocabularies"):
        list(gen)
    wait_closed(draft_server)


class IdsTokenizer:
    """Token ids as text: the random pair has no tokenizer."""

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


async def collect(server: TargetServer, request: GenerateRequest) -> tuple[list[int], FinishedEvent]:
    tokens, last = [], None
    async for event in server.generate(request):
        if isinstance(event, FinishedEvent):
            last = event
        else:
            tokens += event.token_ids
    return tokens, last


def make_server(decoder: SpeculativeDecoder, pool: RemoteDraftPool, budget=None) -> TargetServer:
    async def nothing() -> int:
        return 0
    drafter = RemoteMuxDrafter(pool, decoder.policies.layout, VOCAB, "sha")
    scheduler = Scheduler(decoder, SchedulerConfig(kv_tokens=4096, adaptive=False), drafter, budget=budget).start()
    return TargetServer(decoder, IdsTokenizer(), DraftSide(pool, model_name=nothing, num_sessions=nothing), scheduler)


@pytest.mark.parametrize("method", ["ar", "frspec", "evospec"])
def test_target_server_streams_the_engine_output(setup, method):
    """The transport-free TargetServer (scheduler + remote draft): same tokens and counted statistics as in process."""
    local, remote_only, pool, draft_server, _ = setup
    server = make_server(remote_only, pool)
    sampling = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.7, seed=11)
    spec = SpecParams(method=method, vocab={"static_size": 32, "dynamic_size": 8})
    tokens, finished = asyncio.run(collect(server, GenerateRequest(Prompt(token_ids=[4, 50, 51, 7]), sampling, spec,
                                                                   request_id="r")))
    server.close()
    expected = local.generate([4, 50, 51, 7], sampling, spec)
    list(expected)
    assert tokens == expected.output_ids
    assert finished.finish_reason == "length" and finished.request_id == "r" and finished.stats["method"] == method
    for key in COUNTED:
        assert finished.stats[key] == getattr(expected.stats, key), key
    assert server.num_sessions() == 0
    wait_closed(draft_server)


async def collect_all(server: TargetServer, requests: list[GenerateRequest]):
    return await asyncio.gather(*(collect(server, r) for r in requests))


@pytest.mark.parametrize("varying_depth", [False, True], ids=["full-trees", "random-depth"])
def test_concurrent_generations_batched_over_the_stream(setup, varying_depth):
    """Many generations of every method at once, through one scheduler and one multiplexed stream: each equals its
    in-process run. With a random draft depth per step (trees at that depth, steps without any tree whose outcomes
    travel with the next step), greedy output still equals the target's."""
    local, remote_only, pool, draft_server, _ = setup
    server = make_server(remote_only, pool, budget=RandomDepth(1) if varying_depth else None)
    requests = []
    for i in range(12):
        method = ["ar", "sd", "frspec", "evospec"][i % 4]
        temperature = 0.0 if varying_depth or i % 3 else 0.9
        tree = TreeParams(shape="chain", num_draft_tokens=3) if i % 2 else \
            TreeParams(shape="tree", depth=3, branching=2, budget=7)
        requests.append(GenerateRequest(
            Prompt(token_ids=[4 + i, 50, 51, 7][: 1 + i % 4]),
            SamplingParams(max_tokens=10 + i, ignore_eos=True, temperature=temperature, seed=i),
            SpecParams(method=method, tree=tree, vocab={"static_size": 32, "dynamic_size": 8})))
    results = asyncio.run(collect_all(server, requests))
    server.close()
    for request, (tokens, finished) in zip(requests, results):
        p = request.prompt.token_ids
        if varying_depth:
            spec = SpecParams(method="ar")
        else:
            spec = request.spec
        expected = local.generate(p, request.sampling, spec)
        list(expected)
        assert tokens == expected.output_ids, request
        assert finished.finish_reason == "length"
    assert server.scheduler.arena.free_tokens == server.scheduler.arena.capacity
    wait_closed(draft_server)


def test_draft_stream_failures_fall_back_to_target_only(setup):
    """A draft replica with another static vocabulary: the speculative request runs target-only (its statistics
    say why), greedy output unchanged; `ar` on the same scheduler is untouched; the draft holds no session after."""
    local, remote_only, pool, draft_server, _ = setup
    server = make_server(remote_only, pool)
    server.scheduler.drafter.static_vocab_sha = "other"

    async def both():
        return await asyncio.wait_for(asyncio.gather(
            collect(server, GenerateRequest(Prompt(token_ids=[4, 5]), SamplingParams(max_tokens=6),
                                            SpecParams(method="frspec", vocab={"static_size": 32}))),
            collect(server, GenerateRequest(Prompt(token_ids=[4, 5]), SamplingParams(max_tokens=6),
                                            SpecParams(method="ar")))), 30)
    (spec_tokens, spec_done), (ar_tokens, _) = asyncio.run(both())
    server.close()
    assert spec_tokens == ar_tokens and len(ar_tokens) == 6
    assert "different static vocabularies" in spec_done.stats["fallback_reason"]
    assert spec_done.stats["fallback_steps"] == spec_done.stats["steps"]
    wait_closed(draft_server)


def test_generations_survive_the_draft_replica_dying():
    """The draft's gRPC server stops mid-generation: every stream completes target-only from its committed state,
    greedy-identical to target-only decoding."""
    target, draft = random_pair(vocab=VOCAB, seed=9, eos=1)
    local = SpeculativeDecoder(target, draft, static_ids=STATIC)
    draft_server = DraftServer(DraftEngine(draft), VocabPolicies(draft.head_weight, STATIC), "sha")
    grpc_server, port = start_draft_server(draft_server, "127.0.0.1")
    pool = pool_for(f"127.0.0.1:{port}")
    server = make_server(SpeculativeDecoder(target, None, static_ids=STATIC), pool)
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    methods = ["sd", "frspec", "evospec", "ar"]

    async def run():
        async def one(i):
            tokens = []
            async for event in server.generate(GenerateRequest(
                    Prompt(token_ids=[4 + i, 50]), sampling,
                    SpecParams(method=methods[i], vocab={"static_size": 32, "dynamic_size": 8}))):
                if isinstance(event, FinishedEvent):
                    return tokens, event
                tokens += event.token_ids
                if len(tokens) >= 8 and i == 0:
                    grpc_server.stop(grace=None)  # the draft replica dies while all four stream
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(4))), 60)

    results = asyncio.run(run())
    server.close()
    pool.close()
    for i, (tokens, finished) in enumerate(results):
        expected = local.generate([4 + i, 50], sampling, SpecParams(method="ar"))
        list(expected)
        assert tokens == expected.output_ids
        assert finished.finish_reason == "length"
        if methods[i] != "ar":
            assert finished.stats["fallback_steps"] > 0 and finished.stats["fallback_reason"]
