"""Service metrics: vLLM-compatible names and the values recorded from per-request stats."""
from evospec.adapt.learner import AdaptStats
from evospec.engine.stats import SpecStats
from evospec.services.common.metrics import AdaptMetrics, ServiceMetrics


class Recorder:
    def __init__(self, name, description="", tag_keys=(), boundaries=None):
        self.name, self.tag_keys, self.values = name, tag_keys, []

    def inc(self, value=1, tags=None):
        assert set(tags) == set(self.tag_keys)
        self.values.append((value, dict(tags)))

    observe = set = inc


def test_spec_decode_counters_follow_stats():
    m = ServiceMetrics(backend=lambda: (Recorder, Recorder, Recorder))
    stats = SpecStats(prompt_tokens=5)
    stats.record_step(drafted=4, accepted=3)
    stats.record_step(drafted=4, accepted=1)
    stats.generated_tokens, stats.misses, stats.verified_positions, stats.buffer_updates = 6, 1, 6, 2
    stats.fallback_steps, stats.draft_resumes, stats.predrafted_steps = 3, 1, 1
    stats.buffer_hits_statistical, stats.buffer_hits_target = 2, 1
    m.record(stats, "evospec", ttft_s=0.05, e2e_s=0.30, finish_reason="length", dynamic_size=256)
    t = {"method": "evospec"}
    assert m.num_drafts.name == "spec_decode_num_drafts" and m.num_drafts.values == [(2, t)]
    assert m.num_draft_tokens.values == [(8, t)] and m.num_accepted_tokens.values == [(4, t)]
    assert m.accepted_per_pos.values == [(2, {**t, "position": "0"}), (1, {**t, "position": "1"}),
                                         (1, {**t, "position": "2"})]
    assert m.tpot.values == [((0.30 - 0.05) / 5, t)]
    assert m.misses.values == [(1, t)] and m.verified_positions.values == [(6, t)]
    assert m.buffer_size.values == [(256, t)]
    assert m.buffer_hits.values == [(2, {**t, "source": "statistical"}), (1, {**t, "source": "target"})]
    assert m.fallback_steps.values == [(3, t)] and m.draft_resumes.values == [(1, t)]
    assert m.requests_without_draft.values == [(1, t)]  # one request, however many steps it ran without
    assert m.predrafted_steps.values == [(1, t)]
    assert m.requests.values == [(1, {**t, "finished_reason": "length"})]
    # τ as vLLM defines it, from the counters: 1 + accepted / drafts
    assert 1 + m.num_accepted_tokens.values[0][0] / m.num_drafts.values[0][0] == stats.tau


def test_adapt_metrics_follow_the_learner():
    m = AdaptMetrics(backend=lambda: (Recorder, Recorder, Recorder))
    stats = AdaptStats(mode="lora", version=3, train_steps=10, train_seconds=2.5, signal_bytes=4000, loss_ema=0.7,
                       state_bytes=1 << 20)
    m.record(stats)
    stats.train_steps, stats.signal_bytes, stats.version = 14, 4000, 4
    m.record(stats)
    t = {"mode": "lora"}
    assert m.version.name == "evospec_adapter_version" and m.version.values == [(3, t), (4, t)]
    assert m.train_steps.values == [(10, t), (4, t)]  # increments, not totals
    assert m.signal_bytes.values == [(4000, t)]  # no change, no increment
    assert m.loss.values[-1] == (0.7, t) and m.state_bytes.values[-1] == (1 << 20, t)
