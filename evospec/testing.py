"""Test fixtures that ship with the package: tiny random Qwen3 pairs (no files, no training; also used by the
random-pair benchmark and the GPU check), the chi-square check of the statistical losslessness tests, a scheduler
budget that draws the draft depth at random, and random verify steps."""
from __future__ import annotations

import copy
import os
import random
import time
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode

from evospec.config import SamplingParams
from evospec.engine.budget import OnlineCost, SpeculationBudget, TokenCostTable
from evospec.model.qwen3 import Qwen3, Qwen3Config
from evospec.sampling import sample_without_replacement
from evospec.tree import DraftTree


def tiny_config(vocab: int = 96, hidden: int = 32, layers: int = 2, eos: int = 1) -> Qwen3Config:
    return Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                       max_position_embeddings=1024, eos_token_id=eos)


def random_qwen3(cfg: Qwen3Config, seed: int, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> Qwen3:
    """A model of shape `cfg` with random weights drawn on `device` (a 4B shape in bf16 never exists in float32 on
    the host), scaled so activations stay O(1)."""
    torch.manual_seed(seed)
    on_host = torch.device(device).type == "cpu"
    with torch.device("cpu" if on_host else "meta"):  # on the host, the modules' default init draws from the seed
        model = Qwen3(cfg)                            # first (kept: every test's model stays the same)
    state = {}
    for name, p in model.named_parameters():
        if "norm" in name:
            value = 1.0 + 0.1 * torch.randn(p.shape, device=device)
        else:
            value = torch.randn(p.shape, device=device) / p.shape[-1] ** 0.5
        if name == "embed_tokens.weight":
            value = value * 3.0  # peakier next-token distributions, like a trained model
        state[name] = value.to(dtype)
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval().requires_grad_(False)


def random_pair(vocab: int = 96, seed: int = 0, eos: int = 1, noise: float = 0.3, hidden: int = 32,
                target_layers: int = 2) -> tuple[Qwen3, Qwen3]:
    """(target, draft): the draft is the target's first layer with perturbed weights, so they mostly agree."""
    target = random_qwen3(tiny_config(vocab, hidden, target_layers, eos), seed)
    draft = Qwen3(tiny_config(vocab, hidden, 1, eos))
    state = {k: v for k, v in copy.deepcopy(target.state_dict()).items()
             if not k.startswith("layers.") or k.startswith("layers.0.")}
    draft.load_state_dict(state)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "layers.0" in name and "norm" not in name:
                p.add_(noise * p.std() * torch.randn(p.shape, generator=g))
    return target, draft.eval().requires_grad_(False)


def chi_square_p(counts, probs) -> float:
    """p-value of observed `counts` against the distribution `probs` (numpy arrays of one length); cells with an
    expected count under 5 are pooled. Mass observed where `probs` has none fails at once."""
    import numpy as np
    from scipy.stats import chisquare  # a dev dependency: only tests call this
    probs = probs.astype(np.float64) / probs.astype(np.float64).sum()
    keep = probs * counts.sum() >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(probs[keep], probs[~keep].sum()) * counts.sum()
    exp *= obs.sum() / exp.sum()
    if exp[-1] == 0:
        assert obs[-1] == 0, "mass where the target has none"
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp).pvalue


def exact_two_token_joint(target: Qwen3, prompt: list[int], sampling):
    """p(x1, x2 | prompt) as a numpy array [vocab * vocab], by enumeration with the target alone: the reference the
    statistical tests compare speculative sampling against."""
    import numpy as np

    from evospec.kernels.tree import chain_then_tree_mask
    from evospec.sampling import logits_to_probs

    def next_probs(ids):
        cache = target.new_cache(len(ids))
        h = target(torch.tensor(ids), torch.arange(len(ids)), cache, chain_then_tree_mask(0, len(ids), None))
        return logits_to_probs(target.full_logits(h)[-1:], sampling)[0].double().numpy()
    p1 = next_probs(prompt)
    return np.concatenate([p1[x] * next_probs(prompt + [x]) for x in range(target.cfg.vocab_size)])


class RandomDepth(SpeculationBudget):
    """A draft depth in [0, max_depth] drawn at random each step: any choice made without looking at the draft's
    tokens must be lossless, so tests drive the scheduler with this to reach every depth."""

    def __init__(self, seed: int, max_depth: int = 3):
        super().__init__(TokenCostTable(), OnlineCost(4))
        self.rng, self.max_depth = random.Random(seed), max_depth

    def choose(self, requests, prefill_tokens: int, source: str = "draft") -> int:
        return self.rng.randrange(0, self.max_depth + 1)


class Collector:
    """A scheduler sink that keeps every event of one request."""

    def __init__(self):
        self.events = []

    def __call__(self, event):
        self.events.append(event)

    @property
    def tokens(self) -> list[int]:
        from evospec.engine.scheduler import TokensOut
        return [t for e in self.events if isinstance(e, TokensOut) for t in e.token_ids]

    @property
    def finished(self):
        from evospec.engine.scheduler import Failed, Finished
        return next((e for e in self.events if isinstance(e, Finished | Failed)), None)


TEST_TIER_ENV = "EVOSPEC_TEST_TIER"  # scripts/test.sh sets it: fast | ci (the default) | full
SAMPLE_SHARE = {"fast": 0.25, "ci": 0.5, "full": 1.0}  # of a statistical test's full sample count


def samples(full: int) -> int:
    """A statistical test's sample count in this run's tier: `full` in the nightly tier (`scripts/test.sh
    --full`), a share of it in CI and the fast tier. Every statistical family keeps a negative control run at the
    same count, which must be rejected there: a smaller count must not cost a test its power."""
    tier = os.environ.get(TEST_TIER_ENV, "ci")
    if tier not in SAMPLE_SHARE:
        raise ValueError(f"${TEST_TIER_ENV} is {tier!r}; one of {', '.join(SAMPLE_SHARE)}")
    return max(1, round(full * SAMPLE_SHARE[tier]))


def two_token_counts(decoder, prompt: list[int], sampling: SamplingParams, spec, n: int, batch: int = 250,
                     budget: SpeculationBudget | None = None):
    """(counts, accepted, depths): the first two sampled tokens (x1 * vocab + x2) of `n` seeded generations (seeds
    0..n-1), the draft tokens accepted over them and the steps by draft depth, run `batch` at a time through the
    continuous-batching scheduler (each request draws its own seeded numbers, so a batch gives what `n` lone
    generations would, much faster). The draft prefills with the target, so every step drafts; the depth is each
    request's own unless `budget` chooses it."""
    import numpy as np

    from evospec.config import SchedulerConfig
    from evospec.engine.scheduler import Scheduler
    vocab = decoder.target.model.cfg.vocab_size
    per_request = len(prompt) + sampling.max_tokens + spec.tree.max_nodes + 2
    config = SchedulerConfig(kv_tokens=batch * per_request, max_running=batch, prefill_chunk=batch * len(prompt),
                             adaptive=False, draft_prefill="with_target")
    scheduler = Scheduler(decoder, config, budget=budget)
    counts, accepted = np.zeros(vocab * vocab), 0
    for sink in seeded_runs(scheduler, prompt, sampling, spec, n, batch):
        counts[sink.tokens[0] * vocab + sink.tokens[1]] += 1
        accepted += sink.finished.stats.accepted
    return counts, accepted, scheduler.depth_histogram


def seeded_runs(scheduler, prompt: list[int], sampling: SamplingParams, spec, n: int, batch: int) -> list[Collector]:
    """`n` generations of one prompt with seeds 0..n-1, `batch` at a time through `scheduler`; one sink each."""
    done = []
    for start in range(0, n, batch):
        done += run_all(scheduler, [(prompt, sampling.model_copy(update={"seed": seed}), spec)
                                    for seed in range(start, min(n, start + batch))])
    return done


def run_all(scheduler, requests) -> list[Collector]:
    """Submit every (prompt, sampling, spec) at once and step until all are done; one sink per request."""
    sinks = [Collector() for _ in requests]
    for (prompt, sampling, spec), sink in zip(requests, sinks):
        scheduler.submit(prompt, sampling, spec, sink)
    scheduler.run_until_idle()
    return sinks


def prometheus_values(text: str, ignore: tuple[str, ...] = ("model_name",)) -> dict[str, float]:
    """Every sample of a Prometheus text exposition (prometheus_client's parser), keyed `name|label=value|...` with
    the labels sorted and the `ignore`d ones dropped: what the /metrics tests diff before and after a request."""
    from prometheus_client.parser import text_string_to_metric_families
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sorted((k, v) for k, v in sample.labels.items() if k not in ignore)
            values[sample.name + "".join(f"|{k}={v}" for k, v in labels)] = sample.value
    return values


# ---- verify steps ----------------------------------------------------------------------------------------------------

VERIFY_VOCAB = 40  # random_batch's vocabulary
VERIFY_SAMPLINGS = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
                    SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.0, top_k=8)]


def drafted_tree(rng: random.Random, gen: torch.Generator, size: int, sampling: SamplingParams,
                 active: int) -> DraftTree:
    """A tree shaped at random whose sampled children are drawn, without replacement, from a draft distribution
    over `active` ids of the vocabulary (the rest of the active set: unused dynamic slots, id -1)."""
    if size == 0:
        return DraftTree.empty()
    used = max(2, active - 3)
    active_ids = torch.cat([torch.randperm(VERIFY_VOCAB, generator=gen)[:used], torch.full((active - used,), -1)])
    parents, tokens, probs = [], [], {}
    for i in range(size):
        parent = rng.randrange(-1, i)
        if not sampling.greedy and parent not in probs:
            q = torch.softmax(torch.randn(active, generator=gen) * 2, -1)
            probs[parent] = torch.where(active_ids >= 0, q, 0.0) / q[active_ids >= 0].sum()
        siblings = [t for t, p in zip(tokens, parents) if p == parent]
        if sampling.greedy:
            repeat = siblings and rng.random() < 0.2  # a sibling's token again: the greedy walk takes the first
            token = rng.choice(siblings) if repeat else rng.randrange(VERIFY_VOCAB)
        else:
            drawn = sample_without_replacement(probs[parent], len(siblings) + 1, gen).tolist()
            fresh = [int(active_ids[d]) for d in drawn if int(active_ids[d]) not in siblings]
            if not fresh:
                continue
            token = fresh[0]
        parents.append(parent)
        tokens.append(token)
    tree = DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))
    if not sampling.greedy:
        tree.draft_probs, tree.active_ids = probs, active_ids
    return tree


def random_batch(seed: int, requests: int, max_size: int):
    """(trees, samplings, target logit rows per tree) of a verify step: greedy and sampled requests mixed, trees of
    0..max_size nodes (tests/unit/test_verify_batch.py, bench/gpu_check.py)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    trees, samplings, rows = [], [], []
    for _ in range(requests):
        sampling = rng.choice(VERIFY_SAMPLINGS)
        size, active = rng.randrange(0, max_size + 1), rng.choice([12, 24, VERIFY_VOCAB])
        tree = drafted_tree(rng, gen, size, sampling, active)
        target = torch.randn(1 + tree.size, VERIFY_VOCAB, generator=gen) * 2
        for i, token in enumerate(tree.token_ids.tolist()):  # the target often agrees with the draft
            if rng.random() < 0.6:
                target[tree.parents[i] + 1, token] += 4
        trees.append(tree)
        samplings.append(sampling)
        rows.append(target)
    return trees, samplings, rows


def cuda_syncs(fn: Callable[[], object]) -> tuple[object, list[str]]:
    """`fn()` once to warm up, then again under CUDA's sync debug mode: (its result, the first line of each
    synchronising call it warned about) (tests/gpu, bench/gpu_check.py)."""
    import warnings
    fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return result, [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]


def verify_step_syncs(device: str | torch.device, seed: int = 7):
    """One batched verify step (`verify_on_device`, 8 requests, greedy and sampled) on a CUDA `device`, through
    `cuda_syncs`. Returns (results, (trees, samplings, host logit rows), the synchronising calls)."""
    from evospec.verify import verify_on_device
    trees, samplings, rows = random_batch(seed, 8, 8)
    for tree in trees:
        tree.draft_probs = {k: v.to(device) for k, v in tree.draft_probs.items()}
        tree.active_ids = tree.active_ids.to(device) if tree.active_ids is not None else None
    logits = torch.cat(rows).to(device)
    gens = [torch.Generator(device=device).manual_seed(i) for i in range(len(trees))]
    results, syncs = cuda_syncs(lambda: verify_on_device(trees, logits, samplings, gens))
    return results, (trees, samplings, rows), syncs


def random_feedback_batch(seed: int, requests: int, vocab: int = 500):
    """Random steps for the target's vocabulary feedback (evospec/vocab/retrieval.py): per request its verified rows
    (flat to peaked distributions), committed tokens inside and outside A (repeats too), A's mask, and whether it
    wants candidates. Returns (logits, committed, masks, with_candidates), on the CPU."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    logits, committed, masks, wanted = [], [], [], []
    for _ in range(requests):
        n = rng.randint(1, 5)
        logits.append(torch.randn(n, vocab, generator=gen) * rng.choice([0.5, 2.0, 6.0]))
        masks.append(torch.rand(vocab, generator=gen) < rng.random())
        committed.append([rng.randrange(vocab) for _ in range(n)])
        wanted.append(rng.random() < 0.8)
    return logits, committed, masks, wanted


def feedback_step_syncs(device: str | torch.device, seed: int = 7):
    """One step's batched feedback (`feedbacks_on_device`, 8 requests, Qwen3's vocabulary) on a CUDA `device`,
    through `cuda_syncs`. Returns (results, the CPU inputs, the synchronising calls)."""
    from evospec.vocab.retrieval import feedbacks_on_device
    inputs = random_feedback_batch(seed, 8, vocab=151936)
    logits, committed, masks, wanted = inputs
    on_device = ([rows.to(device) for rows in logits], committed, [mask.to(device) for mask in masks], wanted)
    results, syncs = cuda_syncs(lambda: feedbacks_on_device(*on_device))
    return results, inputs, syncs


def wait_for(condition: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    """Poll `condition` until it holds or `timeout_s` passes; returns its last value (tests: `assert wait_for(...)`)."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


SYNCING_METHODS = {"item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__",
                   "masked_select", "unique", "multinomial", "argwhere"}


class HostSyncCounter(TorchFunctionMode):
    """Counts calls that make the host wait for the device on a GPU: reading values (item, tolist, bool(), ...),
    data-dependent shapes (nonzero, boolean-mask indexing), on a CPU where nothing synchronises, so a test can count
    a GPU's synchronisations without one. `host_tensors` live on the host in production (e.g. a tree's tokens and
    parents: the drafter and the gRPC link hand them over there); reading them is not counted."""
    def __init__(self, host_tensors):
        super().__init__()
        self.host_ids = {id(t) for t in host_tensors}
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        on_host_input = bool(args) and id(args[0]) in self.host_ids
        mask_index = name == "__getitem__" and any(isinstance(a, torch.Tensor) and a.dtype == torch.bool
                                                   for a in _flat(args[1:]))
        if (name in SYNCING_METHODS and not on_host_input) or mask_index:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def _flat(items):
    for item in items:
        if isinstance(item, (tuple, list)):
            yield from _flat(item)
        else:
            yield item
