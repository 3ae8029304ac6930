"""CUDA paths (bf16): skipped without a GPU. Same checks as on CPU: HF parity and greedy identity."""
import pytest
import torch

from evospec.config import SamplingParams, SpecParams, TreeParams
from evospec.engine.generate import SpeculativeDecoder
from evospec.testing import random_pair

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_greedy_identical_on_cuda_bf16():
    target, draft = random_pair(vocab=4096, seed=0, eos=-1, hidden=128)
    target, draft = target.to("cuda", torch.bfloat16), draft.to("cuda", torch.bfloat16)
    dec = SpeculativeDecoder(target, draft, static_ids=torch.arange(2048))
    sampling = SamplingParams(max_tokens=64, ignore_eos=True)
    ref = dec.generate([1, 2, 3], sampling, SpecParams(method="ar"))
    list(ref)
    for method in ("sd", "frspec", "evospec"):
        for tree in (TreeParams(shape="chain", num_draft_tokens=4), TreeParams(shape="tree", budget=16)):
            out = dec.generate([1, 2, 3], sampling, SpecParams(method=method, tree=tree,
                                                               vocab={"static_size": 2048, "dynamic_size": 64}))
            list(out)
            assert out.output_ids == ref.output_ids


def test_hf_folder_loads_on_cuda(tmp_path):
    transformers = pytest.importorskip("transformers")
    from evospec.model import load_qwen3
    cfg = transformers.Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   tie_word_embeddings=True)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(tmp_path)
    model = load_qwen3(tmp_path, device="cuda")
    assert model.embed_tokens.weight.is_cuda and model.embed_tokens.weight.dtype == torch.bfloat16


def test_decoupled_path_with_a_cuda_target():
    """The service's decoupled path (draft behind the internal gRPC stream, on the CPU; target on CUDA, bf16):
    trees, draft distributions and A's ids cross the boundary as CPU data and must land on the target's device.
    Greedy output equals the target alone for every method; sampled requests of every method complete."""
    import asyncio

    from evospec.config import SchedulerConfig
    from evospec.engine.draft import DraftEngine
    from evospec.engine.scheduler import Scheduler
    from evospec.services.config import DraftLinkConfig
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
    from evospec.tokenizer import load_tokenizer
    from evospec.vocab.registry import VocabPolicies

    target, draft = random_pair(vocab=4096, seed=0, eos=-1, hidden=128)
    target = target.to("cuda", torch.bfloat16)
    static = torch.arange(2048)
    draft_server = DraftServer(DraftEngine(draft), VocabPolicies(draft.head_weight, static), "sha")
    grpc_server, port = start_draft_server(draft_server, "127.0.0.1")
    pool = DraftReplicas(lambda: [f"127.0.0.1:{port}"], DraftLinkConfig(step_timeout_s=10))
    assert pool.wait_healthy(1, timeout_s=10)
    decoder = SpeculativeDecoder(target, None, static_ids=static)
    drafter = RemoteMuxDrafter(pool, decoder.policies.layout, 4096, "sha", decoder.target.device)
    scheduler = Scheduler(decoder, SchedulerConfig(kv_tokens=4096, adaptive=False), drafter)

    async def nothing():
        return 0
    server = TargetServer(TargetReplica.serving(scheduler, "sha"), load_tokenizer(), DraftSide(pool, nothing, nothing))

    async def run(sampling, spec):
        tokens, last = [], None
        async for event in server.generate(GenerateRequest(Prompt(token_ids=[1, 2, 3]), sampling, spec)):
            if isinstance(event, FinishedEvent):
                last = event
            else:
                tokens += event.token_ids
        return tokens, last.stats

    try:
        greedy = SamplingParams(max_tokens=48, ignore_eos=True)
        vocab = {"static_size": 2048, "dynamic_size": 64}
        ref, _ = asyncio.run(run(greedy, SpecParams(method="ar")))
        for method in ("sd", "frspec", "evospec"):
            spec = SpecParams(method=method, tree=TreeParams(shape="tree", budget=8), vocab=vocab)
            tokens, stats = asyncio.run(run(greedy, spec))
            assert tokens == ref and stats["fallback_steps"] == 0, method
            sampled = SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.8, top_p=0.9, seed=1)
            tokens, stats = asyncio.run(run(sampled, spec))
            assert len(tokens) == 48 and stats["fallback_steps"] == 0 and stats["steps"] < 48, method
    finally:
        server.close()
        pool.close()
        grpc_server.stop(grace=None)


def test_batched_verification_on_cuda_synchronises_once_and_walks_greedy_as_the_reference():
    """verify_on_device with CUDA tensors: one host synchronisation per step (CUDA's sync debug mode warns on each),
    and greedy requests identical to the per-tree reference on the CPU (sampled ones draw from CUDA generators)."""
    from evospec.testing import verify_step_syncs
    from evospec.verify import verify_greedy
    got, (trees, samplings, rows), syncs = verify_step_syncs("cuda")
    assert len(syncs) == 1, syncs  # the outcome's one copy
    for result, tree, sampling, r in zip(got, trees, samplings, rows):
        if sampling.greedy:
            assert result == verify_greedy(tree, r)


def test_batched_feedback_on_cuda_synchronises_once_and_equals_the_reference():
    """feedbacks_on_device with CUDA tensors (8 requests, Qwen3's vocabulary): one host synchronisation, and the
    misses and buffer candidates of the per-request form on the CPU."""
    import pytest

    from evospec.testing import feedback_step_syncs
    from evospec.vocab.retrieval import target_feedback
    got, inputs, syncs = feedback_step_syncs("cuda")
    assert len(syncs) == 1, syncs
    for fb, args in zip(got, zip(*inputs)):
        want = target_feedback(*args)
        assert (fb.misses, fb.positions, fb.candidates.keys()) == (want.misses, want.positions, want.candidates.keys())
        assert all(fb.candidates[i] == pytest.approx(want.candidates[i], rel=1e-5) for i in want.candidates)
