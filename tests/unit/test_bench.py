"""Benchmark building blocks: the prompt sets and the per-arm metrics (what the grid's tables are made of)."""
import time
from dataclasses import replace

import pytest
import torch

from evospec.bench.adapt import arm_adapt, arm_spec, medical_stream, serve_stream, summarize
from evospec.bench.grid import grid_arms
from evospec.bench.harness import WINDOW, Arm, run_arm
from evospec.bench.misses import replay, rows_of
from evospec.bench.prompts import code_prompts, medical_prompts, topic_switch_prompts
from evospec.config import AdaptConfig, SamplingParams, SpecParams, TreeParams
from evospec.datasets import split_pubmedqa
from evospec.engine.generate import SpeculativeDecoder
from evospec.loading import load_named_pair
from evospec.testing import random_pair
from evospec.vocab.policy import EvoSpecPolicy, EvoSpecSettings


def test_code_prompts_are_distinct_stdlib_function_requests():
    prompts = code_prompts(6)
    texts = [conv[0]["content"] for conv in prompts]
    assert len(set(texts)) == 6 and all(t.startswith("Write a Python function `") for t in texts)
    assert code_prompts(6) == prompts  # deterministic


def test_topic_switch_goes_medical_code_medical_on_held_out_items():
    train, held = split_pubmedqa()
    held_questions = {it["question"] for it in held}
    convs = topic_switch_prompts(3)
    for conv in convs:
        assert [m["role"] for m in conv] == ["user", "assistant", "user", "assistant", "user"]
        assert conv[0]["content"] in held_questions and conv[4]["content"] in held_questions
        assert conv[0]["content"] != conv[4]["content"]
        assert conv[2]["content"].startswith("Write a Python function") and "def " in conv[3]["content"]
    assert not {it["question"] for it in train} & {c[0]["content"] for c in medical_prompts(10)}


def test_grid_arms_cover_k_by_dyna_with_frspec_at_dyna_zero():
    names = [a.name for a in grid_arms(TreeParams(), (8192, 32768), (0, 256), ablations=True)]
    assert names == ["ar", "sd", "frspec-8k", "evospec-8k+256", "frspec-32k", "evospec-32k+256",
                     "evospec-32k+256-stat", "evospec-32k+256-sem", "evospec-32k+256-target"]


@pytest.fixture(scope="module")
def decoder():
    target, draft = random_pair(vocab=96, seed=4, eos=1)
    return SpeculativeDecoder(target, draft, static_ids=torch.arange(0, 96, 3))  # 32 ids: many misses


def test_run_arm_metrics_add_up(decoder):
    spec = SpecParams(method="evospec", vocab={"static_size": 32, "dynamic_size": 8})
    sampling = SamplingParams(max_tokens=2 * WINDOW, ignore_eos=True)
    metrics, outputs = run_arm(decoder, Arm("evospec", spec), [[3, 60, 61], [9, 70]], sampling)
    assert [len(o) for o in outputs] == [2 * WINDOW] * 2
    assert 0 < metrics["recovered"] <= 1 and metrics["miss_rate"] < 1
    shares = [metrics[f"hits_{s}"] for s in ("statistical", "semantic", "target")]
    assert sum(shares) == pytest.approx(1.0)
    assert 1 <= metrics["tau_first32"] and 1 <= metrics["tau_after32"]
    frspec, _ = run_arm(decoder, Arm("frspec", SpecParams(method="frspec", vocab={"static_size": 32})),
                        [[3, 60, 61], [9, 70]], sampling)
    assert frspec["recovered"] == 0 and frspec["miss_rate"] > metrics["miss_rate"]


def test_replay_counts_every_position_outside_s_as_a_hit_or_a_miss():
    _, draft = random_pair(vocab=96, seed=4, eos=1)
    settings = EvoSpecSettings(dynamic_size=8, update_lag=0, use_semantic=False)
    policy = EvoSpecPolicy(draft.head_weight, torch.arange(0, 96, 3), settings)  # S = multiples of 3
    stream = [61, 62, 64, 61, 62, 64, 3, 6, 61]  # 7 positions outside S
    stats = replay(policy, [([5], stream)])
    assert stats.verified_positions == 9 and stats.misses + stats.buffer_hits == 7
    # the first step's three misses are fed back and recur: hits credited to the target-fed source
    assert (stats.misses, stats.buffer_hits_target, stats.buffer_hits_statistical) == (3, 4, 0)
    no_target = EvoSpecPolicy(draft.head_weight, torch.arange(0, 96, 3), replace(settings, use_target=False))
    stats = replay(no_target, [([5], stream)])  # the same misses now reach D only through the statistical counts
    assert stats.buffer_hits_target == 0 and stats.misses + stats.buffer_hits == 7


def test_head_row_counts_of_cost_names():
    assert rows_of("full", 151936) == 151936
    assert rows_of("16k", 151936) == 16384 and rows_of("8k+1024", 151936) == 9216


@pytest.mark.slow
@pytest.mark.nightly  # the benchmark tool's own run; adaptation stays lossless: tests/unit/test_adapt.py
def test_bench_adapt_stream_on_the_tiny_pair_is_lossless_and_the_adapters_change():
    """`evospec bench adapt` in CI size: a short medical stream on the tiny pair, adaptation off and LoRA, same
    prompts and seeds: every greedy output is target-only decoding's, and the served adapter moved off zero."""
    prompts = None
    outputs = {}
    for arm in ("off", "lora"):
        loaded = load_named_pair(adapt=arm_adapt(arm, AdaptConfig(positions_per_example=16, window=48,
                                                                 max_time_share=1.0)))
        try:
            prompts = prompts or medical_stream(loaded.tokenizer, 6)
            sampling = SamplingParams(max_tokens=24, ignore_eos=True)
            result = serve_stream(loaded, prompts, list(range(6)), arm_spec(arm, 4096, 64), sampling)
            outputs[arm] = [r["output"] for r in result["rows"]]
            if arm == "lora":
                learner = loaded.decoder.learner
                deadline = time.monotonic() + 60
                while learner.stats.version < 1 and time.monotonic() < deadline:
                    time.sleep(0.05)
                learner.before_step()  # what the next draft step would do
                assert learner.stats.version >= 1 and not learner.stats.error
                assert any(float(b.abs().max()) > 0 for _, b in learner.bank.serving.values())
                assert result["rows"][-1]["teacher_bytes"] > 0
            ar = []
            for p in prompts:
                gen = loaded.decoder.generate(p, sampling, SpecParams(method="ar"))
                list(gen)
                ar.append(gen.output_ids)
            assert outputs[arm] == ar, arm
        finally:
            loaded.decoder.close()
    summary = summarize({arm: {"rows": [{"index": i, "tau": 2.0, "tokens_per_s": 1.0, "step_seconds": 0.1,
                                         "teacher_bytes": 0, "steps": 1, "output": o}
                                        for i, o in enumerate(outs)],
                               "rss_samples": [(0.0, 100.0)], "peak_rss_mb": 100.0, "wall_seconds": 1.0,
                               "learner": None} for arm, outs in outputs.items()}, n=6, w=2)
    assert summary["compared_requests"] == 6 and summary["output_mismatches"] == []


def test_step_model_terms_from_a_profile_and_its_shapes():
    """bench/projection.py: the terms read from a step profile, and what each shape's step costs."""
    from evospec.bench.projection import StepCosts, from_profile, h200_projection
    profile = {"steps": 10, "depths": {"0": 2, "4": 8},
               "seconds": {"verify": 3.0, "draft": 1.2, "draft.remote_compute": 1.0, "draft.remote_predraft": 0.8,
                           "admit": 0.1}}
    stats = [{"generated_tokens": 25, "predrafted_steps": 4}]
    c = from_profile(profile, stats, levels=4)
    assert c.verify == pytest.approx(300) and c.drafting == pytest.approx(0.8)
    assert c.draft == pytest.approx(125) and c.transport == pytest.approx(25)  # per drafting step
    assert c.predraft == pytest.approx(100) and c.hit == pytest.approx(0.5) and c.tau == pytest.approx(2.5)
    assert c.decoupled_ms() == pytest.approx(300 + 10 + 0.8 * 150)
    costs = StepCosts(verify=10, draft=6, transport=1, predraft=8, draft_forward=2, tau=2, hit=1.0)
    assert costs.overlap_ms() == pytest.approx(11)  # every tree ready: the verify and the round trip
    assert replace(costs, hit=0.0).overlap_ms() == pytest.approx(costs.decoupled_ms() + 2)  # plus one stopped forward
    assert replace(costs, predraft=15).overlap_ms() == pytest.approx(16)  # a pre-draft longer than the verify shows
    rows = {r["shape"]: r for r in h200_projection()}
    assert rows["decoupled, chain 4"]["vs_colocated"] < 1 < rows["overlap h=0.7, chain 4"]["vs_colocated"]


def test_batch_invariance_diagnostic_reports_every_way_and_row_count():
    """`evospec.bench.batch_invariance` (issue 39's diagnostic) on tiny shapes: a verdict per way and row count, costs,
    and the whole forward's logit difference; a forward is always equal to itself (k = 1 rows: 0.0)."""
    from evospec.bench.batch_invariance import WAYS, forward_invariance, linear_invariance
    table = linear_invariance(48, 32, torch.float32, repeats=1, rows=(2, 3))
    assert set(table) == set(WAYS)
    assert all(len(r["invariant"]) == 2 and r["ms_1"] > 0 and r["ms_5"] > 0 for r in table.values())
    from evospec.bench.batch_invariance import operand_order
    from evospec.kernels import linear
    deltas = forward_invariance(torch.float32, layers=1, rows=(1, 3), prefix=4, hidden=48, mlp=96, vocab=64)
    assert deltas[1] == 0.0 and deltas[3] >= 0.0
    measured = linear.weight_first
    with operand_order(False):
        assert linear.weight_first(torch.zeros(4, 4)) is False
    assert linear.weight_first is measured
