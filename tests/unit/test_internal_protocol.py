"""The draft<->target stream on a plain gRPC server (no Ray): a generation whose draft runs behind the stream is
identical to the in-process one (greedy and seeded sampling), including EvoSpec buffer updates and misses."""
import time

import grpc
import pytest
import torch

from evospec.config import SamplingParams, SpecParams, TreeParams
from evospec.engine.draft import DraftEngine
from evospec.engine.generate import SpeculativeDecoder
from evospec.vocab.registry import VocabPolicies
from helpers import random_pair
from services.draft.servicer import DraftServicer, start_draft_server
from services.target.remote_draft import RemoteDrafter

VOCAB = 96
STATIC = torch.arange(0, VOCAB, 3)  # 32 ids: many misses, so the buffer works


@pytest.fixture(scope="module")
def setup():
    target, draft = random_pair(vocab=VOCAB, seed=9, eos=1)
    local = SpeculativeDecoder(target, draft, static_ids=STATIC)
    servicer = DraftServicer(DraftEngine(draft), VocabPolicies(draft.head_weight, STATIC), "sha")
    server, port = start_draft_server(servicer, "127.0.0.1")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    remote_only = SpeculativeDecoder(target, None, static_ids=STATIC)
    yield local, remote_only, channel, servicer
    channel.close()
    server.stop(grace=None)


def remote_factory(channel, static_ids):
    def make(prompt, sampling, spec, max_len, seed):
        layout = VocabPolicies(None, static_ids).layout(spec)
        return RemoteDrafter(channel, "req-1", prompt, sampling, spec, max_len, seed, layout, VOCAB, "sha", 30)
    return make


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
    local, remote_only, channel, servicer = setup
    spec = SpecParams(method=method, tree=tree, vocab={"static_size": 32, "dynamic_size": 8})
    a = local.generate([4, 50, 51, 7], sampling, spec)
    b = remote_only.generate([4, 50, 51, 7], sampling, spec, drafter_factory=remote_factory(channel, STATIC))
    list(a), list(b)
    assert b.output_ids == a.output_ids
    for key in ("steps", "drafted", "accepted", "misses", "buffer_updates"):
        assert getattr(b.stats, key) == getattr(a.stats, key), key
    deadline = time.monotonic() + 10  # the draft frees the session when it sees the stream end (asynchronously)
    while servicer.num_sessions() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert servicer.num_sessions() == 0


def test_mismatched_static_vocabulary_is_refused(setup):
    _, remote_only, channel, _ = setup
    def make(prompt, sampling, spec, max_len, seed):
        layout = VocabPolicies(None, STATIC).layout(spec)
        return RemoteDrafter(channel, "req-2", prompt, sampling, spec, max_len, seed, layout, VOCAB, "other", 30)
    gen = remote_only.generate([4, 5], SamplingParams(max_tokens=4), SpecParams(method="frspec",
                                                                                 vocab={"static_size": 32}),
                               drafter_factory=make)
    with pytest.raises(Exception, match="different static vocabularies"):
        list(gen)
