"""Target engine: the target model, a per-session KV cache, verification of a draft tree in one forward.

The target cache holds every committed token except the last one (`pending`); a step forwards [pending] + tree
nodes with a tree mask, verifies, then commits pending and the accepted nodes' K/V (compacted, no recomputation).
An empty tree makes the step plain autoregressive decoding (method `ar`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from evospec.config import SamplingParams
from evospec.kernels.tree import chain_then_tree_mask, chain_then_tree_positions
from evospec.model import KVCache, Qwen3
from evospec.sampling import logits_to_probs
from evospec.tree import DraftTree
from evospec.verify import VerifyResult, verify_greedy, verify_stochastic


@dataclass
class TargetSession:
    cache: KVCache
    tokens: list[int]  # committed sequence; tokens[-1] is pending (not in the cache yet)
    sampling: SamplingParams
    generator: torch.Generator


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

    @torch.inference_mode()
    def start(self, prompt_ids: list[int], sampling: SamplingParams, max_len: int, seed: int) -> TargetSession:
        """Prefill all prompt tokens but the last (which becomes pending)."""
        cache = self.model.new_cache(max_len)
        prefix = prompt_ids[:-1]
        if prefix:
            mask = chain_then_tree_mask(0, len(prefix), None)
            self.model(torch.tensor(prefix), torch.arange(len(prefix)), cache, mask)
            cache.advance(len(prefix))
        generator = torch.Generator(device=self.device).manual_seed(seed)
        return TargetSession(cache, list(prompt_ids), sampling, generator)

    @torch.inference_mode()
    def verify(self, session: TargetSession, tree: DraftTree) -> VerifiedStep:
        cache = session.cache
        parents = tree.parents if tree.size else None
        mask = chain_then_tree_mask(cache.length, 1, parents)
        positions = chain_then_tree_positions(cache.length, 1, parents)
        input_ids = torch.cat([torch.tensor([session.tokens[-1]]), tree.token_ids])
        hidden = self.model(input_ids, positions, cache, mask)  # [1 + n, hidden]
        logits = self.model.full_logits(hidden)  # [1 + n, V]
        if session.sampling.greedy:
            result = verify_greedy(tree, logits)
        else:
            result = verify_stochastic(tree, logits_to_probs(logits, session.sampling), session.generator)
        # commit pending (slot cache.length) and the accepted nodes (node i sits at slot cache.length + 1 + i)
        cache.commit([cache.length] + [cache.length + 1 + i for i in result.accepted_nodes])
        session.tokens.extend(result.committed_tokens)
        rows = torch.tensor([0] + [1 + i for i in result.accepted_nodes], device=logits.device)
        return VerifiedStep(result, logits.index_select(0, rows))
