"""In-process speculative generation: the step loop (draft tree -> target verify -> commit) and its stop rules.

`SpeculativeDecoder` owns one target and optionally one draft model and serves every method through the same loop:
a method that does not draft (`SpecParams.speculative` false: `ar`) verifies empty trees, `lookup` verifies chains
from the request's own context (engine/lookup.py), the others differ only in the draft's vocabulary policy
(evospec.vocab.registry).
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from evospec.adapt import Learner, build_learner
from evospec.config import AdaptConfig, SamplingParams, SpecParams, draft_seed, traits
from evospec.engine.draft import DraftEngine
from evospec.engine.drafter import Drafter, DrafterFactory, DraftRequest, LocalDrafter, NoDrafter
from evospec.engine.lookup import LookupDrafter
from evospec.engine.stats import SpecStats
from evospec.engine.target import TargetEngine
from evospec.errors import InvalidRequestError
from evospec.model import Qwen3
from evospec.vocab.registry import VocabPolicies
from evospec.vocab.retrieval import CoocIndex


@dataclass
class Chunk:
    """Tokens committed by one step (after stop-rule truncation)."""
    token_ids: list[int]


@dataclass
class Generation:
    """Iterate to run the steps; `finish_reason` ('stop' | 'length') and `stats` are final once exhausted."""
    steps: Iterator[Chunk]
    stats: SpecStats
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    def __iter__(self) -> Iterator[Chunk]:
        return self.steps


def apply_stop_rules(new_tokens: list[int], generated: int, sampling: SamplingParams,
                     eos_ids: frozenset[int]) -> tuple[list[int], str | None]:
    """Truncate one step's tokens at the first EOS (dropped, finish 'stop') or at max_tokens (finish 'length')."""
    if not sampling.ignore_eos:
        for i, tok in enumerate(new_tokens):
            if tok in eos_ids and generated + i < sampling.max_tokens:
                return new_tokens[:i], "stop"
    room = sampling.max_tokens - generated
    if len(new_tokens) >= room:
        return new_tokens[:room], "length"
    return new_tokens, None


class SpeculativeDecoder:
    def __init__(self, target: Qwen3, draft: Qwen3 | None = None, static_ids: torch.Tensor | None = None,
                 max_model_len: int | None = None, eos_ids: tuple[int, ...] | None = None,
                 cooc: CoocIndex | None = None, adapt: AdaptConfig = AdaptConfig()):
        """eos_ids: the ids generation stops on (evospec.loading.stop_token_ids); None = the config's eos id.
        adapt: online adaptation of the draft (its worker starts here; `close` stops it)."""
        self.target = TargetEngine(target)
        learner = build_learner(draft, adapt) if draft is not None else None
        self.draft = DraftEngine(draft, learner) if draft is not None else None
        if learner is not None:
            learner.start()
        self.policies = VocabPolicies(draft.head_weight if draft is not None else None, static_ids, cooc,
                                      quantized_head=draft.head if draft is not None else None)
        self.max_model_len = max_model_len or target.cfg.max_position_embeddings
        self.eos_ids = frozenset(eos_ids if eos_ids is not None else (target.cfg.eos_token_id,))

    @property
    def learner(self) -> Learner | None:
        return self.draft.learner if self.draft is not None else None

    def close(self) -> None:
        """Stop the adaptation worker (if any); the decoder still serves, with the last version."""
        if self.learner is not None:
            self.learner.close()

    def validate(self, prompt_ids: list[int], sampling: SamplingParams, spec: SpecParams,
                 remote_draft: bool = False) -> None:
        if not prompt_ids:
            raise InvalidRequestError("prompt", "is empty; send at least one token")
        vocab = self.target.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError("prompt_token_ids", f"ids must be in [0, {vocab}); got {bad[:3]}")
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequestError("prompt", f"has {len(prompt_ids)} tokens; the context holds {self.max_model_len}"
                                                f" including at least one generated token")
        if len(prompt_ids) + sampling.max_tokens > self.max_model_len:
            raise InvalidRequestError("sampling.max_tokens", f"prompt ({len(prompt_ids)}) + max_tokens "
                                                             f"({sampling.max_tokens}) exceeds the context length "
                                                             f"{self.max_model_len}")
        if spec.speculative:
            self.policies.layout(spec)
            if not remote_draft:
                if self.draft is None:
                    raise InvalidRequestError("spec.method",
                                              f"'{spec.method}' needs a draft model; this server has none")
                self.policies.get(spec)  # built once per server and method, before the first request needs it

    def generate(self, prompt_ids: list[int], sampling: SamplingParams, spec: SpecParams,
                 drafter_factory: DrafterFactory | None = None) -> Generation:
        """Validates eagerly (raises InvalidRequestError), then returns a lazy Generation.

        drafter_factory replaces the in-process draft (the decoupled service passes one that opens a stream to the
        draft replica)."""
        self.validate(prompt_ids, sampling, spec, remote_draft=drafter_factory is not None)
        seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(8), "little")
        gen = Generation(iter(()), SpecStats(prompt_tokens=len(prompt_ids)))
        gen.steps = self._run(gen, list(prompt_ids), sampling, spec, seed, drafter_factory or self.local_drafter)
        return gen

    def local_drafter(self, request: DraftRequest) -> Drafter:
        policy = self.policies.get(request.spec)
        session = self.draft.start(request.prompt_ids, request.sampling, request.spec.tree, policy, request.max_len,
                                   request.seed)
        return LocalDrafter(self.draft, session)

    def _run(self, gen: Generation, prompt_ids, sampling, spec, seed, drafter_factory) -> Iterator[Chunk]:
        max_len = len(prompt_ids) + sampling.max_tokens + spec.tree.max_nodes + 2
        target_session = self.target.start(prompt_ids, sampling, max_len, seed)
        if spec.speculative:
            drafter = drafter_factory(DraftRequest(prompt_ids, sampling, spec, max_len, draft_seed(seed)))
        elif traits(spec.method).lookup:
            drafter = LookupDrafter(prompt_ids, sampling, spec.tree.levels)
        else:
            drafter = NoDrafter()
        try:
            while True:
                t0 = time.perf_counter()
                tree = drafter.propose()
                t1 = time.perf_counter()
                verified = self.target.verify(target_session, tree)
                gen.stats.draft_seconds += t1 - t0
                gen.stats.verify_seconds += time.perf_counter() - t1
                gen.stats.record_step(tree.size, len(verified.result.accepted_nodes), tree.depth)
                committed = verified.result.committed_tokens
                tokens, gen.finish_reason = apply_stop_rules(committed, len(gen.output_ids), sampling, self.eos_ids)
                gen.output_ids.extend(tokens)
                gen.stats.generated_tokens = len(gen.output_ids)
                if gen.finish_reason is None:  # feed back only when another step follows
                    t2 = time.perf_counter()
                    drafter.observe(verified, gen.stats)
                    gen.stats.draft_seconds += time.perf_counter() - t2
                if tokens:
                    yield Chunk(tokens)
                if gen.finish_reason is not None:
                    return
        finally:
            drafter.close()
