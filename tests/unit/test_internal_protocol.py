"""The draft<->target stream on a plain gRPC server (no Ray): a generation whose draft runs behind the stream is
identical to the in-process one (greedy and seeded sampling), including EvoSpec buffer updates and misses; and the
transport-free TargetServer streams the same tokens and statistics as typed events."""
import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from evospec.adapt import build_learner
from evospec.config import AdaptConfig, SamplingParams, SchedulerConfig, SpecParams, TreeParams
from evospec.engine.budget import CatchUp
from evospec.engine.draft import DraftEngine
from evospec.engine.generate import SpeculativeDecoder
from evospec.engine.runner import SchedulerThread
from evospec.engine.scheduler import Finished, Scheduler, TokensOut
from evospec.engine.stats import SpecStats
from evospec.errors import InvalidRequestError
from evospec.services.config import DraftLinkConfig, InternalStreamConfig
from evospec.services.draft.server import DraftServer
from evospec.services.draft.servicer import start_draft_server
from evospec.services.target.draft_link import DraftReplicas
from evospec.services.target.remote_draft import RemoteMuxDrafter
from evospec.services.target.server import (
    DraftSide,
    FinishedEvent,
    GenerateRequest,
    Prompt,
    TargetReplica,
    TargetServer,
)
from evospec.testing import RandomDepth, random_pair, wait_for
from evospec.tokenizer import load_tokenizer
from evospec.vocab.registry import VocabPolicies

VOCAB = 96
STATIC = torch.arange(0, VOCAB, 3)  # 32 ids: many misses, so the buffer works
COUNTED = ("steps", "drafted", "accepted", "accepted_per_pos", "generated_tokens", "misses", "verified_positions",
           "buffer_updates", "buffer_hits_statistical", "buffer_hits_semantic", "buffer_hits_target")


def pool_for(*addresses: str) -> DraftReplicas:
    """Draft replicas at fixed addresses (the service discovers them through Serve), probed healthy."""
    pool = DraftReplicas(lambda: addresses, DraftLinkConfig(step_timeout_s=5, retry_s=0.1, refresh_s=0.5))
    assert pool.wait_healthy(len(addresses), timeout_s=10)
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


def wait_closed(draft_server: DraftServer) -> None:
    # the draft frees the session when it sees the stream end (asynchronously)
    assert wait_for(lambda: draft_server.num_sessions() == 0, 10)


CASES = [
    ("sd", SamplingParams(max_tokens=40, ignore_eos=True)),
    ("frspec", SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, top_p=0.9, seed=3)),
    ("evospec", SamplingParams(max_tokens=40, ignore_eos=True)),
    ("evospec", SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, seed=5)),
]


def generate_over_the_stream(decoder: SpeculativeDecoder, pool: DraftReplicas, prompt: list[int],
                             sampling: SamplingParams, spec: SpecParams, sha: str = "sha"):
    """One generation through the scheduler (adaptive off: every step drafts the request's full tree, as the
    per-request loop does) with its drafts from the draft server over SpeculateBatch -> (tokens, last event)."""
    drafter = RemoteMuxDrafter(pool, decoder.policies.layout, VOCAB, sha)
    exact = SchedulerConfig(kv_tokens=4096, adaptive=False, draft_prefill="with_target")  # the loop's order
    scheduler = Scheduler(decoder, exact, drafter)
    events = []
    scheduler.submit(prompt, sampling, spec, events.append)
    scheduler.run_until_idle()
    drafter.flush()  # the last step's close reaches the draft
    drafter.shutdown()
    tokens = [t for e in events if isinstance(e, TokensOut) for t in e.token_ids]
    return tokens, events[-1]


@pytest.mark.parametrize("method,sampling", CASES, ids=[f"{m}-T{s.temperature}" for m, s in CASES])
@pytest.mark.parametrize("tree", [TreeParams(shape="chain", num_draft_tokens=3),
                                  TreeParams(shape="tree", depth=3, branching=2, budget=7)], ids=["chain", "tree"])
def test_remote_equals_local(setup, method, sampling, tree):
    """The draft behind the stream drafts exactly what the in-process draft of the per-request loop drafts: same
    tokens (greedy and seeded sampling) and the same counted statistics, buffer updates and misses included."""
    local, remote_only, pool, draft_server, _ = setup
    spec = SpecParams(method=method, tree=tree, vocab={"static_size": 32, "dynamic_size": 8})
    a = local.generate([4, 50, 51, 7], sampling, spec)
    list(a)
    tokens, finished = generate_over_the_stream(remote_only, pool, [4, 50, 51, 7], sampling, spec)
    assert isinstance(finished, Finished), finished
    assert tokens == a.output_ids
    for key in COUNTED:
        assert getattr(finished.stats, key) == getattr(a.stats, key), key
    assert finished.stats.fallback_steps == 0
    assert finished.stats.draft_head_seconds > 0  # measured on the draft side, reported over the stream
    if method == "evospec":
        assert finished.stats.buffer_update_seconds > 0
    wait_closed(draft_server)


def test_mismatched_static_vocabulary_is_refused(setup):
    """A draft replica with another static vocabulary never drafts for this target: the generation runs target-only
    from its first step, its statistics say why, and it never tries to resume (a reconnect cannot fix it)."""
    local, remote_only, pool, draft_server, _ = setup
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    tokens, finished = generate_over_the_stream(remote_only, pool, [4, 5], sampling,
                                                SpecParams(method="frspec", vocab={"static_size": 32}), sha="other")
    assert isinstance(finished, Finished), finished
    assert tokens == ar_tokens(local, [4, 5], 8)
    assert "different static vocabularies" in finished.stats.fallback_reason
    assert finished.stats.fallback_steps == finished.stats.steps and finished.stats.draft_resumes == 0
    wait_closed(draft_server)


async def collect(server: TargetServer, request: GenerateRequest) -> tuple[list[int], FinishedEvent]:
    tokens, last = [], None
    async for event in server.generate(request):
        if isinstance(event, FinishedEvent):
            last = event
        else:
            tokens += event.token_ids
    return tokens, last


def mux_drafter(decoder: SpeculativeDecoder, pool: DraftReplicas) -> RemoteMuxDrafter:
    return RemoteMuxDrafter(pool, decoder.policies.layout, VOCAB, "sha")


async def nothing() -> int:
    """The control-plane queries a test's DraftSide never needs (model name, session count)."""
    return 0


def make_server(decoder: SpeculativeDecoder, pool: DraftReplicas, budget=None) -> TargetServer:
    scheduler = Scheduler(decoder, SchedulerConfig(kv_tokens=4096, adaptive=False, draft_prefill="with_target"),
                          mux_drafter(decoder, pool), budget=budget)
    return TargetServer(TargetReplica.serving(scheduler, "sha"), load_tokenizer(),
                        DraftSide(pool, model_name=nothing, num_sessions=nothing))


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
        method = ["ar", "sd", "frspec", "evospec", "lookup"][i % 5]
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


def make_scheduler(decoder: SpeculativeDecoder, pool: DraftReplicas, **config) -> SchedulerThread:
    """A scheduler over the stream to `pool`, running on its own thread (as in a target replica)."""
    # with_target: the per-request loop's order, so counted statistics and seeded samples compare exactly
    config = {"kv_tokens": 16384, "adaptive": False, "draft_retry_s": 0.05, "draft_max_retry_s": 0.5,
              "draft_prefill": "with_target", **config}
    return SchedulerThread(Scheduler(decoder, SchedulerConfig(**config), mux_drafter(decoder, pool))).start()


class TimedSink:
    """Collects a request's tokens with their arrival times; `pace_s` slows the scheduler down (it calls sinks on
    its thread) so that generations outlast the failures the tests inject."""

    def __init__(self, pace_s: float = 0.0):
        self.tokens, self.times, self.end, self.pace_s = [], [], None, pace_s

    def __call__(self, event):
        if isinstance(event, TokensOut):
            self.tokens += event.token_ids
            self.times.append(time.monotonic())
            time.sleep(self.pace_s)
        else:
            self.end = event

    def longest_gap(self) -> float:
        return max((b - a for a, b in zip(self.times, self.times[1:])), default=0.0)


def ar_tokens(local: SpeculativeDecoder, prompt: list[int], max_tokens: int) -> list[int]:
    gen = local.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), SpecParams(method="ar"))
    list(gen)
    return gen.output_ids


def spec_for(method: str) -> SpecParams:
    return SpecParams(method=method, vocab={"static_size": 32, "dynamic_size": 8})


def test_two_draft_replicas_one_dies_the_others_sessions_are_untouched():
    """Sessions spread over two draft replicas by load. One replica's server stops mid-generation: its sessions go
    on target-only and resume on the surviving replica; the survivor's sessions never notice (statistics identical
    to an in-process run); every output is greedy-identical to target-only decoding."""
    target, draft = random_pair(vocab=VOCAB, seed=9, eos=1)
    local = SpeculativeDecoder(target, draft, static_ids=STATIC)
    draft_servers = [DraftServer(DraftEngine(draft), VocabPolicies(draft.head_weight, STATIC), "sha") for _ in "ab"]
    started = [start_draft_server(s, "127.0.0.1") for s in draft_servers]
    pool = pool_for(*(f"127.0.0.1:{port}" for _, port in started))
    runner = make_scheduler(SpeculativeDecoder(target, None, static_ids=STATIC), pool)
    scheduler = runner.scheduler
    methods = ["sd", "frspec", "evospec", "ar"] * 2
    sinks = [TimedSink(pace_s=0.002) for _ in methods]
    sampling = SamplingParams(max_tokens=120, ignore_eos=True)
    handles = [scheduler.submit([4 + i, 50], sampling, spec_for(m), sink)
               for i, (m, sink) in enumerate(zip(methods, sinks))]
    assert wait_for(lambda: all(len(s.tokens) >= 8 for s in sinks), 30)
    held = [s.num_sessions() for s in draft_servers]
    started[0][0].stop(grace=None)  # replica a dies while all eight stream
    assert wait_for(lambda: all(s.end is not None for s in sinks), 60)
    runner.stop()
    pool.close()
    started[1][0].stop(grace=None)
    assert held == [3, 3]  # six speculative sessions, spread by load
    untouched = 0
    for i, (method, sink, handle) in enumerate(zip(methods, sinks, handles)):
        assert isinstance(sink.end, Finished), sink.end
        assert sink.tokens == ar_tokens(local, [4 + i, 50], 120)
        stats = handle.stats
        if method == "ar":
            continue
        if stats.fallback_steps == 0:
            untouched += 1
            expected = local.generate([4 + i, 50], sampling, spec_for(method))
            list(expected)
            for key in COUNTED:
                assert getattr(stats, key) == getattr(expected.stats, key), key
        else:
            assert stats.draft_resumes >= 1, stats  # moved to the surviving replica
    assert untouched == 3


@pytest.mark.slow
def test_a_frozen_draft_replica_stalls_nothing_and_speculation_comes_back():
    """The draft process is frozen (SIGSTOP) for 3 s, longer than the step deadline: the streams keep producing
    tokens (no gap near the freeze's length), and once it is thawed, speculation resumes in the same generations.
    Outputs stay greedy-identical to target-only decoding."""
    script = str(Path(__file__).with_name("draft_process.py"))
    proc = subprocess.Popen([sys.executable, script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        target, draft = random_pair(vocab=VOCAB, seed=9, eos=1)
        local = SpeculativeDecoder(target, draft, static_ids=STATIC)
        pool = DraftReplicas(lambda: [f"127.0.0.1:{port}"],
                             DraftLinkConfig(step_timeout_s=0.5, retry_s=0.1, max_retry_s=0.5, probe_timeout_s=0.3))
        assert pool.wait_healthy(1, timeout_s=30)
        runner = make_scheduler(SpeculativeDecoder(target, None, static_ids=STATIC), pool)
        scheduler = runner.scheduler
        methods = ["sd", "frspec", "evospec", "ar"]
        sinks = [TimedSink(pace_s=0.005) for _ in methods]
        handles = [scheduler.submit([4 + i, 50], SamplingParams(max_tokens=1000, ignore_eos=True), spec_for(m), sink)
                   for i, (m, sink) in enumerate(zip(methods, sinks))]
        assert wait_for(lambda: all(len(s.tokens) >= 8 for s in sinks), 30)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(3.0)
        os.kill(proc.pid, signal.SIGCONT)
        resumed = wait_for(lambda: all(h.stats.draft_resumes and h.stats.drafted > h.stats.fallback_steps
                                       for h in handles[:3]), 30)
        for handle in handles:
            handle.cancel()
        assert wait_for(lambda: scheduler.num_running() == 0, 10)
        runner.stop()
        pool.close()
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.stdin.close()
        proc.wait(timeout=10)
    assert resumed, [h.stats for h in handles]
    for i, sink in enumerate(sinks):
        assert sink.tokens == ar_tokens(local, [4 + i, 50], len(sink.tokens))
        assert sink.longest_gap() < 2.0, (methods[i], sink.longest_gap())
    for handle in handles[:3]:
        assert handle.stats.fallback_steps > 0 and handle.stats.fallback_reason


class SlowDraftServer(DraftServer):
    """Alive but slower than the step deadline's floor: every engine step takes `delay_s`."""

    delay_s = 0.3

    def run_step(self, ops, work):
        time.sleep(self.delay_s)
        return super().run_step(ops, work)


@pytest.mark.slow
def test_a_slow_but_alive_draft_replica_is_waited_for():
    """A draft replica whose every step takes longer than step_timeout_s: after a late step or two it is given
    its own time (measured; one step also waits for the reply to the last outcomes, so it takes two delays), and
    speculation runs instead of falling back step after step."""
    target, draft = random_pair(vocab=VOCAB, seed=9, eos=1)
    local = SpeculativeDecoder(target, draft, static_ids=STATIC)
    slow = SlowDraftServer(DraftEngine(draft), VocabPolicies(draft.head_weight, STATIC), "sha")
    grpc_server, port = start_draft_server(slow, "127.0.0.1")
    pool = DraftReplicas(lambda: [f"127.0.0.1:{port}"], DraftLinkConfig(step_timeout_s=0.1, retry_s=0.05))
    try:
        assert pool.wait_healthy(1, timeout_s=10)
        runner = make_scheduler(SpeculativeDecoder(target, None, static_ids=STATIC), pool)
        scheduler = runner.scheduler
        sink = TimedSink(pace_s=0.02)  # the target-only steps after the first late one take a while too
        handle = scheduler.submit([4, 50], SamplingParams(max_tokens=40, ignore_eos=True), spec_for("frspec"), sink)
        assert wait_for(lambda: sink.end is not None, 60)
        runner.stop()
    finally:
        pool.close()
        grpc_server.stop(grace=None)
    assert sink.tokens == ar_tokens(local, [4, 50], 40)
    assert handle.stats.draft_resumes <= 2 and handle.stats.drafted > 0  # a late step or two, then it is timed
    assert handle.stats.fallback_steps < handle.stats.steps / 2, handle.stats


def test_a_draft_replica_restarted_at_a_new_address_is_found_and_used():
    """The draft replica is replaced (the old address refuses, a new one appears, as when Serve restarts it):
    discovery finds the new one, and running generations as well as new requests speculate on it again."""
    target, draft = random_pair(vocab=VOCAB, seed=9, eos=1)
    local = SpeculativeDecoder(target, draft, static_ids=STATIC)
    addresses: list[str] = []

    def new_replica():
        server = DraftServer(DraftEngine(draft), VocabPolicies(draft.head_weight, STATIC), "sha")
        grpc_server, port = start_draft_server(server, "127.0.0.1")
        addresses[:] = [f"127.0.0.1:{port}"]
        return grpc_server
    first = new_replica()
    pool = DraftReplicas(lambda: list(addresses), DraftLinkConfig(step_timeout_s=2, retry_s=0.1, refresh_s=0.5))
    assert pool.wait_healthy(1, timeout_s=10)
    runner = make_scheduler(SpeculativeDecoder(target, None, static_ids=STATIC), pool)
    scheduler = runner.scheduler
    sinks = [TimedSink(pace_s=0.003) for _ in range(2)]
    handles = [scheduler.submit([4 + i, 50], SamplingParams(max_tokens=1000, ignore_eos=True), spec_for("evospec"),
                                sink) for i, sink in enumerate(sinks)]
    assert wait_for(lambda: all(len(s.tokens) >= 8 for s in sinks), 30)
    first.stop(grace=None)
    second = new_replica()
    try:
        assert wait_for(lambda: all(h.stats.draft_resumes for h in handles), 30), [h.stats for h in handles]
        fresh = TimedSink()
        late = scheduler.submit([9, 50], SamplingParams(max_tokens=16, ignore_eos=True), spec_for("frspec"), fresh)
        assert wait_for(lambda: fresh.end is not None, 30)
        for handle in handles:
            handle.cancel()
        assert wait_for(lambda: scheduler.num_running() == 0, 10)
    finally:
        runner.stop()
        pool.close()
        second.stop(grace=None)
    assert late.stats.fallback_steps == 0 and late.stats.drafted > 0
    for i, sink in enumerate(sinks):
        assert sink.tokens == ar_tokens(local, [4 + i, 50], len(sink.tokens))


def test_an_adapting_draft_learns_over_the_stream_and_greedy_output_stays_the_targets(setup, tmp_path):
    """The draft replica adapts online (LoRA): the target sends the teacher signal it asked for in its replies, the
    replica trains and swaps versions while serving, and every greedy output still equals target-only decoding."""
    local = setup[0]
    target, draft = random_pair(vocab=VOCAB, seed=9, eos=1)
    adapt = AdaptConfig(mode="lora", positions_per_example=4, window=16, min_examples=1, batch_size=2,
                        publish_every=1, max_time_share=1.0, lr=1e-2, teacher_top_k=4)
    draft_server = DraftServer(DraftEngine(draft, build_learner(draft, adapt)), VocabPolicies(draft.head_weight, STATIC),
                               "sha")
    draft_server.learner.start()
    grpc_server, port = start_draft_server(draft_server, "127.0.0.1")
    pool = pool_for(f"127.0.0.1:{port}")
    server = make_server(SpeculativeDecoder(target, None, static_ids=STATIC), pool)
    try:
        for round_ in range(3):
            requests = [GenerateRequest(Prompt(token_ids=[4 + i, 50 + round_, 51, 7]),
                                        SamplingParams(max_tokens=16, ignore_eos=True),
                                        spec_for(["sd", "frspec", "evospec"][i % 3])) for i in range(6)]
            for request, (tokens, finished) in zip(requests, asyncio.run(collect_all(server, requests))):
                assert tokens == ar_tokens(local, request.prompt.token_ids, 16)
                if round_:  # the first replies told the target to send the signal
                    assert finished.stats["teacher_signal_bytes"] > 0
        assert wait_for(lambda: draft_server.learner.stats.version >= 1, 30)
        stats = draft_server.learner.stats
        assert stats.positions > 0 and stats.signal_bytes > 0 and not stats.error
        other_rank = build_learner(random_pair(vocab=VOCAB, seed=9)[1], adapt.model_copy(update={"rank": 4}))
        with pytest.raises(InvalidRequestError, match="rank"):
            draft_server.load_adapter(other_rank.export(tmp_path / "rank4.safetensors").read_bytes())
        assert draft_server.load_adapter(draft_server.export_adapter()) > stats.version - 1
    finally:
        server.close()
        pool.close()
        grpc_server.stop(grace=None)
        draft_server.shutdown()


def test_a_malformed_teacher_signal_fails_its_session_only():
    from evospec.adapt.signal import TeacherSignal
    from evospec.services.common.convert import session_op_from_proto, teacher_to_proto
    from evospec.services.draft.server import Op
    from evospec.services.protocol.v1 import speculation_pb2 as spec_pb
    from evospec.verify import VerifyResult
    good = TeacherSignal(torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, 4, dtype=torch.float16))
    msg = teacher_to_proto(good)
    for field, broken in (("token_ids", spec_pb.TeacherSignal(k=4, token_ids=[2**31 + 5, 0, 0, 0],
                                                               logprobs=msg.logprobs)),
                          ("logprobs", spec_pb.TeacherSignal(k=4, token_ids=[0] * 4,
                                                             logprobs=np.full(4, np.nan, "<f2").tobytes())),
                          ("teacher", spec_pb.TeacherSignal(k=3, token_ids=[0] * 4, logprobs=msg.logprobs))):
        op = spec_pb.SessionOp(session_id="s", outcome=spec_pb.Outcome(accepted_nodes=[], accepted_tokens=[],
                                                                       bonus_token=1, teacher=broken))
        with pytest.raises(InvalidRequestError, match=field):
            session_op_from_proto(op)
    _, draft = random_pair(vocab=VOCAB, seed=9, eos=1)
    adapt = AdaptConfig(mode="lora", teacher_top_k=8)
    server = DraftServer(DraftEngine(draft, build_learner(draft, adapt)), VocabPolicies(draft.head_weight, STATIC))
    from evospec.engine.drafter import DraftRequest
    request = DraftRequest([4, 5, 6], SamplingParams(), spec_for("evospec"), 64, 0)
    steps = server.run_step([Op("a", "start", request), Op("b", "start", request)], {"a": (2, 0), "b": (2, 0)})
    wrong_k = Op("a", "outcome", result=VerifyResult([], [], 7), candidates={}, teacher=good)  # k 4, asked 8
    fine = Op("b", "outcome", result=VerifyResult([], [], 7), candidates={},
              teacher=TeacherSignal(torch.zeros(1, 8, dtype=torch.int32), torch.zeros(1, 8, dtype=torch.float16)))
    steps = server.run_step([wrong_k, fine], {"b": (2, 0)})
    assert isinstance(steps["a"].error, InvalidRequestError) and "teacher.k" in str(steps["a"].error)
    assert steps["b"].error is None and steps["b"].tree is not None
    server.shutdown()


def test_a_stream_closed_for_idleness_is_reopened_without_a_fallback():
    """The draft closes streams idle past `idle_timeout_s` (InternalStreamConfig); a target whose stream was closed
    while it had no sessions opens a fresh one for its next session: no step runs target-only."""
    target, draft = random_pair(vocab=VOCAB, seed=9, eos=1)
    draft_server = DraftServer(DraftEngine(draft), VocabPolicies(draft.head_weight, STATIC), "sha")
    grpc_server, port = start_draft_server(draft_server, "127.0.0.1", InternalStreamConfig(idle_timeout_s=0.5))
    pool = pool_for(f"127.0.0.1:{port}")
    server = make_server(SpeculativeDecoder(target, None, static_ids=STATIC), pool)
    request = GenerateRequest(Prompt(token_ids=[4, 50, 51, 7]), SamplingParams(max_tokens=16, ignore_eos=True),
                              SpecParams(method="sd"))
    try:
        first, stats = asyncio.run(collect(server, request))
        assert stats.stats["steps"] < 16  # the draft's tokens are accepted
        time.sleep(2.0)  # the draft closes the idle stream
        links = list(server.scheduler.drafter._links.values())
        assert links and all(link.stream.dead for link in links)
        second, again = asyncio.run(collect(server, request))
        assert second == first and again.stats["fallback_steps"] == 0 and again.stats["steps"] < 16
    finally:
        server.close()
        pool.close()
        grpc_server.stop(grace=None)


@pytest.mark.parametrize("same_model", [False, True], ids=["random-draft", "draft-equals-target"])
def test_predrafted_trees_change_nothing_but_the_wait(same_model):
    """Pre-drafting (the draft drafts the likeliest outcomes' next trees while the target verifies): greedy output and
    every counted statistic equal the in-process run's, for chains and trees of every method; trees are answered from
    pre-drafts (always, when the draft is the target itself: its top outcome is then always right); sampled
    requests and requests that turn it off never are. A miss costs little: pre-drafting stops at the next forward
    once the outcome is there."""
    target, draft = random_pair(vocab=VOCAB, seed=9, eos=1)
    draft = target if same_model else draft
    local = SpeculativeDecoder(target, draft, static_ids=STATIC)
    draft_server = DraftServer(DraftEngine(draft), VocabPolicies(draft.head_weight, STATIC), "sha", predraft_hypotheses=3)
    grpc_server, port = start_draft_server(draft_server, "127.0.0.1")
    pool = pool_for(f"127.0.0.1:{port}")
    remote_only = SpeculativeDecoder(target, None, static_ids=STATIC)
    # A target slower than pre-drafting, so that no outcome interrupts it (test_predraft_stops_when_the_outcome_is_in
    # covers the interruption).
    step = remote_only.target.step
    remote_only.target.step = lambda *args: (time.sleep(0.1), step(*args))[1]
    try:
        server = make_server(remote_only, pool)
        requests = []
        for method in ("sd", "evospec"):
            for tree in (TreeParams(shape="chain", num_draft_tokens=3), TreeParams(shape="tree", depth=3, branching=2,
                                                                                   budget=6)):
                for temperature, predraft in ((0.0, True), (0.0, False), (0.9, True)):
                    requests.append(GenerateRequest(
                        Prompt(token_ids=[4, 50, 51, 7]), SamplingParams(max_tokens=30, ignore_eos=True,
                                                                         temperature=temperature, seed=2),
                        SpecParams(method=method, tree=tree, vocab={"static_size": 32, "dynamic_size": 8},
                                   predraft=predraft)))
        results = asyncio.run(collect_all(server, requests))
        server.close()
    finally:
        pool.close()
        grpc_server.stop(grace=None)
    for request, (tokens, finished) in zip(requests, results):
        expected = local.generate(request.prompt.token_ids, request.sampling, request.spec)
        list(expected)
        assert tokens == expected.output_ids, request
        if request.sampling.greedy:
            for key in COUNTED:
                assert finished.stats[key] == getattr(expected.stats, key), (key, request)
        predrafted = finished.stats["predrafted_steps"]
        if not (request.sampling.greedy and request.spec.predraft):
            assert predrafted == 0, request
        elif same_model:  # every tree after the first, except after a bonus outside A (no draft can predict it)
            assert predrafted == finished.stats["steps"] - 1 - finished.stats["misses"], request
        else:
            assert predrafted > 0, request


def test_predraft_stops_when_the_outcome_is_in():
    """Pre-drafting asks between forwards whether the next message is there: stopped before its trees are finished,
    it leaves no option (the outcome is then drafted as usual), and the session's state is untouched."""
    target, draft = random_pair(vocab=VOCAB, seed=9, eos=1)
    engine = DraftEngine(draft)
    policies = VocabPolicies(draft.head_weight, STATIC)
    spec = SpecParams(method="sd", tree=TreeParams(shape="chain", num_draft_tokens=3))
    session = engine.start([4, 50, 51, 7], SamplingParams(max_tokens=20), spec.tree, policies.get(spec), 30, 0,
                           hypotheses=2)
    engine.propose(session)
    asked = []
    engine.predraft([session], stop=lambda: asked.append(1) or len(asked) > 2)  # stop before the trees' levels
    assert len(asked) == 3 and session.predraft.options == []
    assert session.predraft.in_flight is not None and session.cache.length == 4
    engine.predraft([session])
    assert len(session.predraft.options) == 2


@pytest.mark.parametrize("interval", [1, 5])
def test_stream_interval_groups_tokens_and_never_holds_the_first_or_the_last(setup, interval):
    """PublicApiConfig.stream_interval: after the first message (sent at once), messages carry at least `interval`
    tokens, except the last; the tokens are the engine's, in order."""
    local, remote_only, pool, draft_server, _ = setup
    server = make_server(remote_only, pool)
    server.stream_interval = interval
    sampling = SamplingParams(max_tokens=23, ignore_eos=True)
    spec = SpecParams(method="evospec", vocab={"static_size": 32, "dynamic_size": 8})

    async def messages():
        return [e async for e in server.generate(GenerateRequest(Prompt(token_ids=[4, 50, 51, 7]), sampling, spec))]
    events = asyncio.run(messages())
    server.close()
    chunks = [e.token_ids for e in events if not isinstance(e, FinishedEvent)]
    expected = local.generate([4, 50, 51, 7], sampling, spec)
    list(expected)
    assert [t for c in chunks for t in c] == expected.output_ids
    assert all(len(c) >= interval for c in chunks[1:-1]) and isinstance(events[-1], FinishedEvent)
    if interval > 1:
        assert len(chunks) < expected.stats.steps  # fewer messages than steps
    wait_closed(draft_server)


def test_a_failing_predraft_is_turned_off_and_never_fails_the_stream():
    """Pre-drafting is optional work: when it raises, its sessions go on drafting as usual over the same stream (no
    fallback to target-only, the same greedy output) and it is off for them from then on."""
    target, draft = random_pair(vocab=VOCAB, seed=9, eos=1)
    local = SpeculativeDecoder(target, draft, static_ids=STATIC)
    engine = DraftEngine(draft)
    calls = []

    def broken(sessions, stop):
        calls.append(len(sessions))
        raise RuntimeError("pre-draft forward failed")
    engine._predraft = broken
    draft_server = DraftServer(engine, VocabPolicies(draft.head_weight, STATIC), "sha", predraft_hypotheses=2)
    grpc_server, port = start_draft_server(draft_server, "127.0.0.1")
    pool = pool_for(f"127.0.0.1:{port}")
    try:
        server = make_server(SpeculativeDecoder(target, None, static_ids=STATIC), pool)
        sampling = SamplingParams(max_tokens=20, ignore_eos=True)
        spec = SpecParams(method="evospec", vocab={"static_size": 32, "dynamic_size": 8})
        tokens, finished = asyncio.run(collect(server, GenerateRequest(Prompt(token_ids=[4, 50, 51, 7]), sampling,
                                                                       spec)))
        server.close()
    finally:
        pool.close()
        grpc_server.stop(grace=None)
    expected = local.generate([4, 50, 51, 7], sampling, spec)
    list(expected)
    assert tokens == expected.output_ids
    assert finished.stats["fallback_steps"] == 0 and finished.stats["predrafted_steps"] == 0
    assert calls == [1]  # tried once, then off for that session


def test_an_outcome_of_a_step_without_a_tree_only_appends_its_tokens(monkeypatch):
    """Depth 0 (or catching up): the draft appends the step's tokens and leaves its vocabulary buffer alone, as the
    in-process drafter does; after a tree, the outcome goes through the full update."""
    from evospec.engine.drafter import DraftRequest
    from evospec.services.draft.server import Op
    from evospec.verify import VerifyResult
    _, draft = random_pair(vocab=VOCAB, seed=9, eos=1)
    server = DraftServer(DraftEngine(draft), VocabPolicies(draft.head_weight, STATIC))
    advanced = []
    real_advance = server.engine.advance
    monkeypatch.setattr(server.engine, "advance", lambda *a, **k: advanced.append(1) or real_advance(*a, **k))
    request = DraftRequest([4, 5, 6], SamplingParams(), spec_for("evospec"), 64, 0)
    server.run_step([Op("a", "start", request)], {})
    steps = server.run_step([Op("a", "outcome", result=VerifyResult([], [], 7), candidates={7: 1.0})], {})
    assert steps["a"].error is None and steps["a"].changes == [] and advanced == []
    assert server._sessions["a"].draft.tokens == [4, 5, 6, 7]
    steps = server.run_step([], {"a": (2, 0)})  # a tree ...
    assert steps["a"].tree is not None
    server.run_step([Op("a", "outcome", result=VerifyResult([], [], 8), candidates={})], {})  # ... then its outcome
    assert advanced == [1] and server._sessions["a"].draft.tokens == [4, 5, 6, 7, 8]
    server.shutdown()


def test_deferred_catch_up_over_the_stream_overlaps_the_target_and_stays_lossless(setup):
    """draft_prefill deferred (the default) over the stream: the draft prefills the prompt in chunks sent without
    waiting (`RemoteMuxDrafter.prefill`) after the first token, then drafts; greedy output equals ar's."""
    local, remote_only, pool, _, _ = setup
    runner = make_scheduler(remote_only, pool, draft_prefill="deferred", prefill_chunk=8)
    scheduler = runner.scheduler
    scheduler.drafter.overlap_prefill = True  # what a GPU target gets (a CPU one shares its cores with the draft)
    sends = []
    real_prefill = scheduler.drafter.prefill
    scheduler.drafter.prefill = lambda prefills: sends.append(dict(prefills)) or real_prefill(prefills)
    prompt, sink = [(5 * j) % (VOCAB - 2) + 2 for j in range(30)], TimedSink()
    try:
        handle = scheduler.submit(prompt, SamplingParams(max_tokens=24, ignore_eos=True), spec_for("evospec"), sink)
        assert wait_for(lambda: sink.end is not None, 30)
    finally:
        runner.stop()
    assert isinstance(sink.end, Finished) and sink.tokens == ar_tokens(local, prompt, 24)
    assert sum(n for sent in sends for n in sent.values()) == len(prompt) - 1 and len(sends) == 4
    assert handle.stats.drafted > 0 and handle.stats.fallback_steps == 0


@dataclass
class SelfDraftedRun:
    """One greedy `sd` chain request through the scheduler and a real draft stream whose draft is the target itself
    (every chain it drafts over a context it fully holds is accepted whole): what was sent, what came out."""
    sink: TimedSink
    stats: SpecStats
    sent: list
    draft_server: DraftServer
    ar: list[int]  # the target's own greedy tokens


def run_self_drafted(monkeypatch, budget, prompt: list[int], max_tokens: int, draft_prefill: str = "deferred",
                     stream: InternalStreamConfig | None = None) -> SelfDraftedRun:
    from evospec.services.target import remote_draft
    target, _ = random_pair(vocab=VOCAB, seed=9, eos=1)
    draft_server = DraftServer(DraftEngine(target), VocabPolicies(target.head_weight, STATIC), "sha")
    grpc_server, port = start_draft_server(draft_server, "127.0.0.1", stream or InternalStreamConfig())
    pool = pool_for(f"127.0.0.1:{port}")
    sent = []
    real_send = remote_draft._MuxStream.send
    monkeypatch.setattr(remote_draft._MuxStream, "send", lambda self, msg: sent.append(msg) or real_send(self, msg))
    remote_only = SpeculativeDecoder(target, None, static_ids=STATIC)
    config = SchedulerConfig(kv_tokens=4096, draft_prefill=draft_prefill, lookup_fallback=False)
    scheduler = Scheduler(remote_only, config, mux_drafter(remote_only, pool), budget=budget)
    sink = TimedSink()
    spec = SpecParams(method="sd", tree=TreeParams(shape="chain", num_draft_tokens=2))
    try:
        handle = scheduler.submit(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), spec, sink)
        scheduler.run_until_idle()
    finally:
        pool.close()
        grpc_server.stop(grace=None)
    ar = ar_tokens(SpeculativeDecoder(target, target, static_ids=STATIC), prompt, max_tokens)
    return SelfDraftedRun(sink, handle.stats, sent, draft_server, ar)


class DraftsEveryFourthStep(RandomDepth):
    """A budget that drafts (depth 2) one step in four and runs the others target-only."""

    def __init__(self):
        super().__init__(seed=0)
        self.calls = 0

    def choose(self, requests, prefill_tokens: int, source: str = "draft") -> int:
        self.calls += 1
        return 2 if self.calls % 4 == 0 else 0


@pytest.mark.parametrize("max_ops", [64, 3], ids=["appends-wait-for-a-tree", "appends-bounded"])
def test_steps_without_a_tree_send_the_draft_no_message(monkeypatch, max_ops):
    """Steps a session does not draft send nothing of their own: their appends wait for the next message (a tree's
    work, a close), at most `_Link.APPENDS_MAX_OPS` of them. The draft, here the target itself, still has every
    token before it drafts: each of its greedy chains is accepted whole, and the output is ar's."""
    from evospec.services.target import remote_draft
    monkeypatch.setattr(remote_draft._Link, "APPENDS_MAX_OPS", max_ops)
    prompt = [(7 * j) % (VOCAB - 2) + 2 for j in range(12)]
    run = run_self_drafted(monkeypatch, DraftsEveryFourthStep(), prompt, 40, draft_prefill="with_target")
    sink, stats, sent = run.sink, run.stats, run.sent
    assert isinstance(sink.end, Finished) and sink.tokens == run.ar
    assert stats.drafted > 0 and stats.accepted == stats.drafted and stats.fallback_steps == 0
    outcomes = [len(msg.ops) for msg in sent]
    assert sum(outcomes) >= stats.steps  # every step's outcome reached the draft ...
    trees = stats.drafted // 2
    # ... in two messages per tree (its work, its outcome), the start and the close, not one per step
    assert len(sent) <= 2 * trees + 2 + stats.steps // max_ops < stats.steps
    assert max(outcomes) <= min(max_ops, 4) + 1


class DraftsFromStep(RandomDepth):
    """A budget that buys the draft's catch-up at the `first` decode step it is asked (None: never), and drafts
    (depth 2) every step once the draft has caught up."""

    def __init__(self, first: int | None):
        super().__init__(seed=0)
        self.first, self.asked = first, 0

    def choose(self, requests, prefill_tokens: int, source: str = "draft") -> int:
        return 2 if self.first is not None else 0

    def catch_up(self, saved_per_token, kind, remaining_tokens: int, lag: int) -> CatchUp:
        self.asked += 1
        return CatchUp(self.first is not None and self.asked >= self.first, 0.0, 0.0, "the test's schedule")


@pytest.mark.parametrize("first_tree", [None, 9], ids=["never-drafted", "drafted-from-step-9"])
def test_a_session_starts_on_its_replica_with_its_first_work(monkeypatch, first_tree):
    """A request the budget never drafts for sends its draft replica nothing (no start, no appends, no close); one
    first drafted later starts there over its context so far (prompt and committed tokens) with that first tree's
    work, and the draft, here the target itself, then has every token: each greedy chain is accepted whole."""
    prompt = [(7 * j) % (VOCAB - 2) + 2 for j in range(12)]
    run = run_self_drafted(monkeypatch, DraftsFromStep(first_tree), prompt, 40)
    sink, stats, sent, draft_server = run.sink, run.stats, run.sent, run.draft_server
    assert isinstance(sink.end, Finished) and sink.tokens == run.ar
    assert draft_server.num_sessions() == 0
    if first_tree is None:
        assert sent == [] and stats.drafted == 0
        return
    assert stats.drafted > 0 and stats.accepted == stats.drafted and stats.fallback_steps == 0
    first = sent[0]
    assert [op.WhichOneof("op") for op in first.ops] == ["start"] and len(first.work) == 1
    started_over = list(first.ops[0].start.prompt_token_ids)
    assert len(started_over) >= len(prompt) + first_tree - 2  # the tokens committed before its first work
    assert started_over == prompt + sink.tokens[:len(started_over) - len(prompt)]


class DraftsAfterAPause(DraftsFromStep):
    """DraftsFromStep(4) whose catch-up decision first waits `pause` seconds (a long stretch without drafting)."""

    def __init__(self, pause: float):
        super().__init__(4)
        self.pause = pause

    def catch_up(self, saved_per_token, kind, remaining_tokens: int, lag: int) -> CatchUp:
        if self.asked == self.first - 1:
            time.sleep(self.pause)
        return super().catch_up(saved_per_token, kind, remaining_tokens, lag)


def test_a_stream_closed_as_idle_before_a_sessions_first_work_is_reopened_for_it(monkeypatch):
    """The replica closes a stream that sent nothing for `idle_timeout_s`, which a link whose sessions were not yet
    given work does: the first work then starts its session on a fresh stream, with no step target-only."""
    prompt = [(5 * j) % (VOCAB - 2) + 2 for j in range(10)]
    run = run_self_drafted(monkeypatch, DraftsAfterAPause(1.5), prompt, 24,
                           stream=InternalStreamConfig(idle_timeout_s=0.3))
    stats = run.stats
    assert isinstance(run.sink.end, Finished) and run.sink.tokens == run.ar
    assert stats.drafted > 0 and stats.accepted == stats.drafted and stats.fallback_steps == 0


def test_the_target_s_budget_starts_from_the_draft_replica_s_measured_forwards(tiny_draft_replica):
    """A draft replica times its forwards when asked (`DraftServer.measure_costs`, what the Draft deployment's
    `costs` answers the target at start-up); the target server's budget then prices a draft level by them instead
    of its guess (a tenth of a target step)."""
    from evospec.engine.budget import draft_features, level_cost
    from evospec.services.config import TargetServiceConfig
    draft, _, pool = tiny_draft_replica
    costs = draft.measure_costs()
    assert set(costs.level_seconds) == {1, 8} and all(seconds > 0 for seconds in costs.level_seconds.values())
    assert costs.prefill_tokens == 16 and costs.prefill_seconds > 0
    server = TargetServer.from_config(TargetServiceConfig(), DraftSide(pool, nothing, nothing))
    try:
        budget = server.scheduler.budget
        assert budget is not None  # adaptive by default
        guess = budget.target_cost(1) / 10
        assert budget.draft_prior(draft_features(1, 1, 1)) == pytest.approx(guess, rel=0.05)
        server.calibrate_draft(costs)
        # the replica's own timings, as the budget fits them (level_cost; on the tiny draft 1 and 8 rows both take
        # ~2 ms, and when 8 happen to time faster than 1 the fit keeps costs from falling with rows)
        measured = level_cost(costs.level_seconds)
        for rows in (1, 8):
            features = draft_features(1, rows, rows)
            assert budget.draft_prior(features) == pytest.approx(measured(features), rel=1e-6)
    finally:
        server.close()
