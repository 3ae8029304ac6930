"""Target engine: the target model, a per-session KV cache, verification of draft trees in one forward.

The target cache holds every committed token except the last one (`pending`); a step forwards [pending] + tree
nodes with a tree mask, verifies, then commits pending and the accepted nodes' K/V (compacted, no recomputation).
An empty tree makes the step plain autoregressive decoding (method `ar`).

`step` is the batched form the scheduler uses: prefill chunks of some sessions and the trees of others in one packed
forward (evospec.model.Segment), the full LM head only on the rows that are verified, then `verify_batch`.
`start` + `verify` are the single-request form of the same code (the per-request loop, the tests' oracle).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from evospec.config import SamplingParams
from evospec.kernels.tree import chain_then_tree_mask, chain_then_tree_positions
from evospec.model import KVCache, Qwen3, Segment
from evospec.tree import DraftTree
from evospec.verify import VerifyResult, verify_batch


@dataclass
class TargetSession:
    cache: KVCache
    tokens: list[int]  # committed sequence; tokens[-1] is pending (not in the cache yet)
    sampling: SamplingParams
    generator: torch.Generator

    @property
    def prefill_remaining(self) -> int:
        """Prompt tokens (all but the pending last one) not in the cache yet."""
        return len(self.tokens) - 1 - self.cache.length


@dataclass(frozen=True)
class VerifiedStep:
    result: VerifyResult
    target_logits: torch.Tensor  # [1 + len(accepted), V] rows at the verified positions (root + accepted path)


class TargetEngine:
    def __init__(self, model: Qwen3):
        self.model = model

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    def open(self, prompt_ids: list[int], sampling: SamplingParams, cache: KVCache, seed: int) -> TargetSession:
        """A session over `cache` with nothing prefilled yet (the scheduler prefills it in chunks through `step`)."""
        generator = torch.Generator(device=self.device).manual_seed(seed)
        return TargetSession(cache, list(prompt_ids), sampling, generator)

    def start(self, prompt_ids: list[int], sampling: SamplingParams, max_len: int, seed: int) -> TargetSession:
        """A session with its own cache, all prompt tokens but the last (which becomes pending) prefilled."""
        session = self.open(prompt_ids, sampling, self.model.new_cache(max_len), seed)
        if session.prefill_remaining:
            self.step([(session, session.prefill_remaining)], [])
        return session

    def verify(self, session: TargetSession, tree: DraftTree) -> VerifiedStep:
        return self.step([], [(session, tree)])[0]

    @torch.inference_mode()
    def step(self, prefills: list[tuple[TargetSession, int]],
             verifies: list[tuple[TargetSession, DraftTree]]) -> list[VerifiedStep]:
        """One packed forward: the next `n` prompt tokens of each prefilling session, and [pending] + tree of each
        verifying session. Commits everything and returns the verifying sessions' steps, in order."""
        segments = [Segment.prefill(s.cache, s.tokens, n) for s, n in prefills]
        segments += [self._verify_segment(s, tree) for s, tree in verifies]
        if not segments:
            return []
        hidden = self.model.forward_packed(segments)  # [T, hidden]
        for session, n in prefills:
            session.cache.advance(n)
        num_prefill_rows = sum(n for _, n in prefills)
        logits = self.model.full_logits(hidden[num_prefill_rows:])  # [sum (1 + n_i), V]
        results = verify_batch([t for _, t in verifies], logits, [s.sampling for s, _ in verifies],
                               [s.generator for s, _ in verifies])
        steps, offset = [], 0
        for (session, tree), result in zip(verifies, results):
            cache = session.cache
            # commit pending (slot cache.length) and the accepted nodes (node i sits at slot cache.length + 1 + i)
            cache.commit([cache.length] + [cache.length + 1 + i for i in result.accepted_nodes])
            session.tokens.extend(result.committed_tokens)
            rows = torch.tensor([offset] + [offset + 1 + i for i in result.accepted_nodes], device=logits.device)
            steps.append(VerifiedStep(result, logits.index_select(0, rows)))
            offset += 1 + tree.size
        return steps

    @staticmethod
    def _verify_segment(session: TargetSession, tree: DraftTree) -> Segment:
        cache = session.cache
        if session.prefill_remaining:
            raise ValueError(f"verify before prefill finished ({session.prefill_remaining} prompt tokens remain)")
        parents = tree.parents if tree.size else None
        input_ids = torch.cat([torch.tensor([session.tokens[-1]]), tree.token_ids])
        return Segment(cache, input_ids, chain_then_tree_positions(cache.length, 1, parents),
                       chain_then_tree_mask(cache.length, 1, parents), cache.length)
