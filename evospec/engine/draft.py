"""Draft engine: the draft model, a per-session KV cache and active vocabulary, and the tree builder.

Tree building (one `propose` call):
1. Feed the committed tokens the draft has not cached yet (at least the last bonus token) as a chain.
2. Root distribution q over A; the root gets `branching` children (greedy: top-k; sampling: Gumbel-top-k, i.e. a
   without-replacement sample, kept in sampling order).
3. Each next level expands the `branching` best new nodes by cumulative log draft probability (EAGLE-2): one
   forward over those nodes with a tree mask, `branching` children each, until `depth` levels.
4. Greedy: keep the `budget` best nodes by cumulative score (ancestor-closed). Sampling: a node is added only with
   all its siblings, and the budget stops further expansions instead of pruning, because pruning a node by its own
   value would bias rejection sampling (a node's presence may depend on earlier nodes, never on itself).
A chain is the same loop with branching 1.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from evospec.config import SamplingParams, TreeParams
from evospec.kernels.tree import chain_then_tree_mask
from evospec.model import KVCache, Qwen3
from evospec.sampling import logits_to_probs, sample_without_replacement
from evospec.tree import DraftTree
from evospec.verify import VerifyResult
from evospec.vocab.policy import SessionVocab, VocabPolicy
from evospec.vocab.retrieval import TargetFeedback


@dataclass
class DraftSession:
    cache: KVCache
    tokens: list[int]  # committed sequence: prompt + generated
    vocab: SessionVocab
    sampling: SamplingParams
    tree_params: TreeParams
    generator: torch.Generator
    forwarded_slot: dict[int, int] = field(default_factory=dict)  # last tree: node -> scratch cache slot
    head_seconds: float = 0.0  # time in the (pruned) LM head: the FR-Spec/EvoSpec bottleneck


@dataclass
class _Node:
    token: int
    parent: int
    depth: int
    score: float  # cumulative log draft probability


class DraftEngine:
    def __init__(self, model: Qwen3):
        self.model = model

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def start(self, prompt_ids: list[int], sampling: SamplingParams, tree_params: TreeParams,
              vocab_policy: VocabPolicy, max_len: int, seed: int) -> DraftSession:
        generator = torch.Generator(device=self.device).manual_seed(seed)
        cache = self.model.new_cache(max_len + tree_params.max_nodes + 1)
        return DraftSession(cache, list(prompt_ids), vocab_policy.new_session(prompt_ids), sampling, tree_params,
                            generator)

    def _children(self, session: DraftSession, logits: torch.Tensor, k: int) -> tuple[list[int], list[float], torch.Tensor]:
        """logits: [|A|] -> (child slots in A, their log q, q [|A|] = the distribution they were drawn from)."""
        if session.sampling.greedy:
            q = logits.softmax(-1)
            slots = logits.topk(min(k, int(torch.isfinite(logits).sum()))).indices
        else:
            q = logits_to_probs(logits, session.sampling)
            slots = sample_without_replacement(q, k, session.generator)
        return slots.tolist(), q[slots].log().tolist(), q

    def _forward(self, session: DraftSession, tokens: list[int], positions: list[int], mask: torch.Tensor,
                 write_start: int) -> torch.Tensor:
        """-> draft logits over A, [len(tokens), |A|]."""
        ids = torch.tensor(tokens, dtype=torch.long)
        hidden = self.model(ids, torch.tensor(positions), session.cache, mask, write_start=write_start)
        start = time.perf_counter()
        logits = session.vocab.active.logits(hidden)
        session.head_seconds += time.perf_counter() - start
        return logits

    def _feed_uncached(self, session: DraftSession) -> torch.Tensor:
        """Forward committed tokens not in the cache yet; returns root logits [|A|]."""
        cache = session.cache
        chain = session.tokens[cache.length:]
        mask = chain_then_tree_mask(cache.length, len(chain), None)
        logits = self._forward(session, chain, list(range(cache.length, cache.length + len(chain))), mask, cache.length)
        cache.advance(len(chain))
        return logits[-1]

    @torch.inference_mode()
    def propose(self, session: DraftSession) -> DraftTree:
        params = session.tree_params
        chain = params.shape == "chain"
        branching = 1 if chain else params.branching
        depth = params.num_draft_tokens if chain else params.depth
        budget = params.max_nodes
        active_ids = session.vocab.active.row_ids
        root_logits = self._feed_uncached(session)
        base = session.cache.length  # scratch slots for tree nodes start here
        budget_limits_expansion = not session.sampling.greedy  # sampling: no pruning, see module docstring

        nodes: list[_Node] = []
        ancestors: list[list[int]] = []
        draft_probs: dict[int, torch.Tensor] = {}
        session.forwarded_slot = {}

        def add_children(parent: int, logits: torch.Tensor) -> list[int]:
            if budget_limits_expansion and len(nodes) + branching > budget:
                return []
            slots, logq, q = self._children(session, logits, branching)
            if not session.sampling.greedy:
                draft_probs[parent] = q
            parent_score = 0.0 if parent < 0 else nodes[parent].score
            parent_depth = 0 if parent < 0 else nodes[parent].depth
            new = []
            for slot, lq in zip(slots, logq):
                nodes.append(_Node(int(active_ids[slot]), parent, parent_depth + 1, parent_score + lq))
                ancestors.append(([] if parent < 0 else ancestors[parent] + [parent]))
                new.append(len(nodes) - 1)
            return new

        frontier = add_children(-1, root_logits)
        for _ in range(depth - 1):
            frontier = sorted(frontier, key=lambda i: -nodes[i].score)[:branching]
            if not frontier:
                break
            logits = self._forward_frontier(session, nodes, ancestors, frontier, base)
            new_level = []
            for row, node in enumerate(frontier):
                new_level += add_children(node, logits[row])
            frontier = new_level

        keep = list(range(len(nodes)))
        if session.sampling.greedy and len(nodes) > budget:
            ranked = sorted(keep, key=lambda i: (-nodes[i].score, nodes[i].depth))
            keep = sorted(ranked[:budget])
        return self._to_tree(session, nodes, keep, draft_probs, active_ids)

    def _forward_frontier(self, session, nodes, ancestors, frontier, base) -> torch.Tensor:
        """Forward the frontier nodes into scratch slots after `base`; returns logits [len(frontier), |A|]."""
        slot_of = session.forwarded_slot
        write_start = base + len(slot_of)
        f = len(frontier)
        mask = torch.zeros(f, write_start + f, dtype=torch.bool)
        mask[:, :base] = True
        for row, node in enumerate(frontier):
            for anc in ancestors[node]:
                mask[row, slot_of[anc]] = True
            mask[row, write_start + row] = True
        positions = [base - 1 + nodes[n].depth for n in frontier]
        logits = self._forward(session, [nodes[n].token for n in frontier], positions, mask, write_start)
        for row, node in enumerate(frontier):
            slot_of[node] = write_start + row
        return logits

    @staticmethod
    def _to_tree(session, nodes, keep, draft_probs, active_ids) -> DraftTree:
        """Renumber the kept nodes 0..n-1 (parents stay before children) and remap forwarded slots."""
        new_index = {old: new for new, old in enumerate(keep)}
        parents = [new_index[nodes[i].parent] if nodes[i].parent >= 0 else -1 for i in keep]
        session.forwarded_slot = {new_index[o]: s for o, s in session.forwarded_slot.items() if o in new_index}
        probs = {(new_index[p] if p >= 0 else -1): q for p, q in draft_probs.items() if p < 0 or p in new_index}
        return DraftTree(torch.tensor([nodes[i].token for i in keep], dtype=torch.long),
                         torch.tensor(parents, dtype=torch.long), probs,
                         active_ids.clone() if probs else None)  # a snapshot: D may change after this step

    def advance(self, session: DraftSession, result: VerifyResult, feedback: TargetFeedback | None) -> list:
        """Between steps: commit the verified step, then let the session vocabulary update (-> its slot changes)."""
        self.commit(session, result)
        return session.vocab.observe(result, feedback if session.vocab.wants_target_feedback else None)

    def commit(self, session: DraftSession, result: VerifyResult) -> None:
        """Keep the cached part of the accepted path (compacted) and append the committed tokens."""
        slots = []
        for node in result.accepted_nodes:
            if node not in session.forwarded_slot:
                break  # the rest of the path (a leaf) was never forwarded: it is fed as a chain next step
            slots.append(session.forwarded_slot[node])
        session.cache.commit(slots)
        session.tokens.extend(result.committed_tokens)
        session.forwarded_slot = {}
