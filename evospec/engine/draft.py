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

Online adaptation (evospec/adapt): with a learner, each verified step's teacher signal is recorded in the session's
trajectory, and every draft step starts by swapping in the newest published weights under the engine's step lock,
so one step (all its tree levels, every session in it) runs on one version.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from evospec.adapt.learner import Learner
from evospec.adapt.replay import Trajectory
from evospec.adapt.signal import TeacherSignal
from evospec.config import SamplingParams, TreeParams
from evospec.engine.predraft import (
    Hypothesis,
    PredraftState,
    forwarded_nodes,
    likely_outcomes,
    path_to,
    predraft_slots,
    region_start,
)
from evospec.model import KVCache, Qwen3, Segment
from evospec.sampling import logits_to_probs, sample_without_replacement
from evospec.tree import DraftTree
from evospec.verify import VerifyResult
from evospec.vocab.active import batched_logits
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
    trajectory: Trajectory | None = None  # teacher positions not yet given to the learner (adaptation on)
    predraft: PredraftState | None = None  # pre-drafting (a decoupled draft, greedy): evospec/engine/predraft.py


@dataclass
class _Node:
    token: int
    parent: int
    depth: int
    score: float  # cumulative log draft probability


class DraftEngine:
    def __init__(self, model: Qwen3, learner: Learner | None = None):
        """learner: online adaptation (evospec.adapt.build_learner), its worker started by the caller."""
        self.model = model
        self.learner = learner
        # With a learner, draft steps of concurrent callers (several target streams) run one at a time, so a
        # version swap never lands inside another step's forwards.
        self._step_lock = threading.Lock() if learner is not None else nullcontext()

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @staticmethod
    def cache_tokens(max_len: int, tree_params: TreeParams, hypotheses: int = 0) -> int:
        """KV slots a session needs: `max_len` (prompt + max_tokens + one tree + 2) plus the scratch that building a
        tree forwards beyond the kept nodes (greedy trees expand `branching` nodes per level and prune afterwards),
        plus pre-drafting's scratch for `hypotheses` predicted outcomes."""
        forwarded = forwarded_nodes(tree_params)
        return max_len + max(0, forwarded - tree_params.max_nodes) + 1 + predraft_slots(tree_params, hypotheses)

    def start(self, prompt_ids: list[int], sampling: SamplingParams, tree_params: TreeParams,
              vocab_policy: VocabPolicy, max_len: int, seed: int, cache: KVCache | None = None,
              hypotheses: int = 0) -> DraftSession:
        """A session over `cache` (a KVArena region from the scheduler) or a cache of its own. hypotheses > 0 (greedy
        only): pre-draft that many predicted outcomes of each tree while the target verifies it."""
        generator = torch.Generator(device=self.device).manual_seed(seed)
        hypotheses = hypotheses if sampling.greedy else 0
        cache = cache if cache is not None else \
            self.model.new_cache(self.cache_tokens(max_len, tree_params, hypotheses))
        trajectory = self.learner.new_trajectory() if self.learner is not None else None
        return DraftSession(cache, list(prompt_ids), vocab_policy.new_session(prompt_ids), sampling, tree_params,
                            generator, trajectory=trajectory,
                            predraft=PredraftState(hypotheses) if hypotheses else None)

    def end(self, session: DraftSession) -> None:
        """The session is over: cancel its pending buffer update, hand its last teacher positions to the learner."""
        session.vocab.close()
        if session.trajectory is not None:
            self.learner.finish(session.trajectory, session.tokens)
            session.trajectory = None

    def propose(self, session: DraftSession, params: TreeParams | None = None) -> DraftTree:
        """One session's next tree (the per-request loop); `params` overrides the session's tree shape."""
        return self.propose_many([(session, params or session.tree_params)])[0]

    def propose_many(self, requests: list[tuple[DraftSession, TreeParams]],
                     prefills: list[tuple[DraftSession, int]] = ()) -> list[DraftTree]:
        """Trees for several sessions with one packed draft forward per tree level (continuous batching); the first
        forward also carries the next `n` prompt tokens of each session in `prefills` (chunked prefill)."""
        with self._step_lock:
            if self.learner is not None:
                self.learner.before_step()  # between steps: the newest adapted weights, whole
            return self._propose_many(requests, prefills)

    @torch.inference_mode()
    def _propose_many(self, requests: list[tuple[DraftSession, TreeParams]],
                      prefills: list[tuple[DraftSession, int]]) -> list[DraftTree]:
        builders = [TreeBuilder(self, session, params, session.predraft.hypotheses if session.predraft else 0)
                    for session, params in requests]
        segments = [Segment.prefill(session.cache, session.tokens, n) for session, n in prefills]
        segments += [b.feed_segment() for b in builders]
        hidden = self.model.forward_packed(segments) if segments else None
        offset = 0
        for session, n in prefills:
            session.cache.advance(n)
            offset += n
        last_rows = []
        for b, seg in zip(builders, segments[len(prefills):]):
            b.session.cache.advance(seg.num_tokens)
            offset += seg.num_tokens
            last_rows.append(hidden[offset - 1:offset])  # the root's distribution comes from the last fed token
        for b, logits in zip(builders, self.heads(builders, last_rows)):
            b.on_feed(logits[0])
        trees = self.expand(builders)
        for b in builders:
            b.session.forwarded_slot = b.slot_of
            if b.session.predraft is not None:
                b.session.predraft.sent(b)  # the tree in flight: what pre-drafting predicts the outcome of
        return trees

    def expand(self, builders: list["TreeBuilder"], stop: Callable[[], bool] | None = None) -> list[DraftTree] | None:
        """Grow started trees level by level, one packed forward per level over all of them (None: `stop` said so
        before a level; with `stop`, pre-drafting, the head time is not the sessions')."""
        while True:
            level = [(b, seg) for b in builders if (seg := b.frontier_segment()) is not None]
            if not level:
                return [b.tree() for b in builders]
            if stop is not None and stop():
                return None
            hidden = self.model.forward_packed([seg for _, seg in level])
            rows, offset = [], 0
            for _, seg in level:
                rows.append(hidden[offset:offset + seg.num_tokens])
                offset += seg.num_tokens
            for (b, _), logits in zip(level, self.heads([b for b, _ in level], rows, account=stop is None)):
                b.on_frontier(logits)

    @staticmethod
    def heads(builders: list["TreeBuilder"], hiddens: list[torch.Tensor], account: bool = True) -> list[torch.Tensor]:
        """Draft logits over each session's A (batched_logits), its time shared out as the sessions' head time
        (`account`: off for pre-drafting, which runs off the critical path)."""
        start = time.perf_counter()
        logits = batched_logits(hiddens, [b.session.vocab.active for b in builders])
        share = (time.perf_counter() - start) / max(1, len(builders))
        for b in builders if account else ():
            b.session.head_seconds += share
        return logits

    def advance(self, session: DraftSession, result: VerifyResult, feedback: TargetFeedback | None,
                teacher: TeacherSignal | None = None) -> list:
        """Between steps: commit the verified step, give its teacher signal to the learner, then let the session
        vocabulary update (-> its slot changes)."""
        changes = self.settle(session)  # a deferred update first: slot changes reach the target in order
        first_position = len(session.tokens)
        hit = session.predraft is not None and session.predraft.match(result)
        self.commit(session, result)
        if teacher is not None and session.trajectory is not None:
            self.learner.record(session.trajectory, session.tokens, first_position, teacher,
                                len(result.accepted_nodes))
        if hit:  # its next tree was drafted with the vocabulary as it is: update it once that tree is sent
            session.predraft.deferred = (result, feedback)
            return changes
        return changes + session.vocab.observe(result, feedback if session.vocab.wants_target_feedback else None)

    def predraft(self, sessions: list[DraftSession], stop: Callable[[], bool] = lambda: False) -> None:
        """While the target verifies: next trees for the likeliest outcomes of each session's tree in flight
        (evospec/engine/predraft.py), with one packed forward per level over all of them. `stop` is asked between
        forwards: once the outcome is there, unfinished work is dropped (a miss then costs at most one forward)."""
        sessions = [s for s in sessions if s.predraft is not None and s.predraft.in_flight is not None]
        if sessions:
            with self._step_lock:
                self._predraft(sessions, stop)

    @torch.inference_mode()
    def _predraft(self, sessions: list[DraftSession], stop: Callable[[], bool]) -> None:
        if stop():  # the outcome is already in: nothing to overlap with
            return
        starts = self._forward_last_level(sessions)
        if stop():
            return
        pending: list[tuple[DraftSession, Hypothesis, list[int], int]] = []  # + the bonus' context slots, position
        segments = []
        for session, slot in starts:
            tree, base = session.predraft.in_flight, session.cache.length
            for node, token in likely_outcomes(tree, session.predraft.hypotheses):
                path = path_to(tree, node)
                context = [tree.slot_of[p] for p in path]
                position = base + len(path)  # the root of the tree in flight is at base - 1
                mask = torch.zeros(1, slot + 1, dtype=torch.bool)
                mask[0, :base] = True
                mask[0, context] = True
                mask[0, slot] = True
                segments.append(Segment(session.cache, torch.tensor([token]), torch.tensor([position]), mask, slot))
                builder = TreeBuilder(self, session, tree.params, session.predraft.hypotheses)
                pending.append((session, Hypothesis(path, token, slot, builder), context, position))
                slot += 1 + forwarded_nodes(tree.params)
        if not segments:
            return
        hidden = self.model.forward_packed(segments)
        builders = [h.builder for _, h, _, _ in pending]
        for (session, h, context, position), logits in zip(pending, self.heads(builders, hidden.split(1), False)):
            h.builder.start(logits[0], prefix_len=session.cache.length, root_position=position,
                            write_from=h.bonus_slot + 1, context_slots=[*context, h.bonus_slot])
        trees = self.expand(builders, stop)
        if trees is None:
            return
        for (session, h, _, _), tree in zip(pending, trees):
            h.tree = tree
            session.predraft.options.append(h)

    def _forward_last_level(self, sessions: list[DraftSession]) -> list[tuple[DraftSession, int]]:
        """Forward each tree in flight's nodes that building it never forwarded (those it never expanded: its last
        level, and nodes the best-first expansion passed over), so that every node has its next-token alternatives
        and a KV slot (a real outcome that accepts one commits it from there).
        Returns each session that has room to pre-draft, with the first slot for its hypotheses."""
        starts, segments, owners = [], [], []
        for session in sessions:
            tree, base = session.predraft.in_flight, session.cache.length
            region = region_start(base, tree.params)
            unforwarded = [i for i in range(len(tree.nodes)) if i not in tree.slot_of]
            end = region + len(unforwarded) + session.predraft.hypotheses * (1 + forwarded_nodes(tree.params))
            if end > session.cache.max_len:  # near the end of its budget: the last steps draft as usual
                session.predraft.in_flight = None
                continue
            starts.append((session, region + len(unforwarded)))
            if not unforwarded:
                continue
            mask = torch.zeros(len(unforwarded), region + len(unforwarded), dtype=torch.bool)
            mask[:, :base] = True
            for row, node in enumerate(unforwarded):
                mask[row, [tree.slot_of[a] for a in path_to(tree, tree.nodes[node].parent)]] = True
                mask[row, region + row] = True
            tokens = torch.tensor([tree.nodes[n].token for n in unforwarded])
            positions = torch.tensor([base - 1 + tree.nodes[n].depth for n in unforwarded])
            segments.append(Segment(session.cache, tokens, positions, mask, region))
            owners.append((tree, unforwarded, region))
        if segments:
            hidden = self.model.forward_packed(segments)
            rows = hidden.split([len(u) for _, u, _ in owners])
            for (tree, unforwarded, region), logits in zip(owners, self.heads([t for t, _, _ in owners], rows,
                                                                              False)):
                for row, node in enumerate(unforwarded):
                    tree.alternatives[node] = tree.best(logits[row], tree.num_alternatives)
                    tree.slot_of[node] = region + row  # the session's forwarded_slot: the same dict
        return starts

    def take_predrafted(self, session: DraftSession, params: TreeParams) -> DraftTree | None:
        """The tree pre-drafted for the outcome just committed, if there is one of the shape asked for now: b and
        the tree's nodes take their places after the committed prefix, as after a normal draft step."""
        state = session.predraft
        hypothesis = state.ready if state is not None else None
        if hypothesis is None:
            return None
        state.ready = None
        builder = hypothesis.builder
        if builder.params != params or session.cache.length != len(session.tokens) - 1:
            return None
        session.cache.commit([hypothesis.bonus_slot])
        nodes = sorted(builder.slot_of, key=builder.slot_of.get)
        session.cache.move_to_scratch([builder.slot_of[n] for n in nodes])
        builder.slot_of = {n: session.cache.length + i for i, n in enumerate(nodes)}
        session.forwarded_slot = builder.slot_of
        state.sent(builder)
        return hypothesis.tree

    def settle(self, session: DraftSession) -> list:
        """The buffer update a pre-drafted hit deferred (-> its slot changes), now that its tree has been sent."""
        state = session.predraft
        if state is None or state.deferred is None:
            return []
        result, feedback = state.deferred
        state.deferred = None
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


class TreeBuilder:
    """One session's tree for one step, built level by level so that a driver can pack many sessions' forwards:
    `feed_segment` -> `on_feed`, then `frontier_segment` -> `on_frontier` until it returns None, then `tree`."""

    def __init__(self, engine: DraftEngine, session: DraftSession, params: TreeParams, alternatives: int = 0):
        """alternatives: also keep each expanded node's next `alternatives` best tokens beyond its children (greedy;
        what pre-drafting ranks the step's possible outcomes by)."""
        self.session = session
        self.params = params
        self.branching = params.width
        self.levels_left = params.levels - 1
        self.budget = params.max_nodes
        self.budget_limits_expansion = not session.sampling.greedy  # sampling: no pruning, see module docstring
        self.active_ids = session.vocab.active.row_ids
        self.nodes: list[_Node] = []
        self.ancestors: list[list[int]] = []
        self.draft_probs: dict[int, torch.Tensor] = {}
        self.frontier: list[int] = []
        self.slot_of: dict[int, int] = {}  # forwarded node -> its scratch cache slot
        # Where the tree sits: every node attends to the committed slots [0, prefix_len) and to `context_slots` (a
        # pre-draft's predicted path); node depth d is at position root_position + d; frontier nodes are written
        # from slot write_from on.
        self.prefix_len = self.root_position = self.write_from = 0
        self.context_slots: list[int] = []
        self.num_alternatives = alternatives if session.sampling.greedy else 0
        self.alternatives: dict[int, list[tuple[int, float]]] = {}  # node (-1 = root) -> best (token, log q)
        self._pending_frontier: list[int] = []

    def feed_segment(self) -> Segment:
        """Committed tokens not in the draft cache yet (at least the last bonus token), as a chain."""
        cache = self.session.cache
        return Segment.chain(cache, self.session.tokens[cache.length:])

    def on_feed(self, root_logits: torch.Tensor) -> None:
        """root_logits: [|A|], after the fed chain is in the cache."""
        base = self.session.cache.length
        self.start(root_logits, prefix_len=base, root_position=base - 1, write_from=base)
        self.session.forwarded_slot = self.slot_of

    def start(self, root_logits: torch.Tensor, prefix_len: int, root_position: int, write_from: int,
              context_slots: Sequence[int] = ()) -> None:
        """The root's children from root_logits [|A|] (the output at `root_position`), and where the tree sits."""
        self.prefix_len, self.root_position, self.write_from = prefix_len, root_position, write_from
        self.context_slots = list(context_slots)
        self.frontier = self._add_children(-1, root_logits)

    def frontier_segment(self) -> Segment | None:
        """The best `branching` new nodes by cumulative score (EAGLE-2), forwarded into scratch slots after the
        nodes already forwarded; None when the tree is complete."""
        if self.levels_left <= 0:
            return None
        nodes = self.nodes
        frontier = sorted(self.frontier, key=lambda i: -nodes[i].score)[:self.branching]
        if not frontier:
            return None
        slot_of = self.slot_of
        write_start = self.write_from + len(slot_of)
        f = len(frontier)
        mask = torch.zeros(f, write_start + f, dtype=torch.bool)
        mask[:, :self.prefix_len] = True
        mask[:, self.context_slots] = True
        for row, node in enumerate(frontier):
            for anc in self.ancestors[node]:
                mask[row, slot_of[anc]] = True
            mask[row, write_start + row] = True
            slot_of[node] = write_start + row
        self._pending_frontier = frontier
        positions = torch.tensor([self.root_position + nodes[n].depth for n in frontier])
        return Segment(self.session.cache, torch.tensor([nodes[n].token for n in frontier], dtype=torch.long),
                       positions, mask, write_start)

    def on_frontier(self, logits: torch.Tensor) -> None:
        """logits: [f, |A|], one row per node of the last frontier segment."""
        new_level = []
        for row, node in enumerate(self._pending_frontier):
            new_level += self._add_children(node, logits[row])
        self.frontier = new_level
        self.levels_left -= 1

    def _add_children(self, parent: int, logits: torch.Tensor) -> list[int]:
        if self.budget_limits_expansion and len(self.nodes) + self.branching > self.budget:
            return []
        slots, logq, q = self._children(logits)
        if not self.session.sampling.greedy:
            self.draft_probs[parent] = q
        if self.num_alternatives:
            self.alternatives[parent] = self.best(logits, self.branching + self.num_alternatives)
        parent_score = 0.0 if parent < 0 else self.nodes[parent].score
        parent_depth = 0 if parent < 0 else self.nodes[parent].depth
        new = []
        for slot, lq in zip(slots, logq):
            self.nodes.append(_Node(int(self.active_ids[slot]), parent, parent_depth + 1, parent_score + lq))
            self.ancestors.append([] if parent < 0 else self.ancestors[parent] + [parent])
            new.append(len(self.nodes) - 1)
        return new

    def _children(self, logits: torch.Tensor) -> tuple[list[int], list[float], torch.Tensor]:
        """logits: [|A|] -> (child slots in A, their log q, q [|A|] = the distribution they were drawn from)."""
        session, k = self.session, self.branching
        if session.sampling.greedy:
            q = logits.softmax(-1)
            slots = logits.topk(min(k, int(torch.isfinite(logits).sum()))).indices
        else:
            q = logits_to_probs(logits, session.sampling)
            slots = sample_without_replacement(q, k, session.generator)
        return slots.tolist(), q[slots].log().tolist(), q

    def best(self, logits: torch.Tensor, n: int) -> list[tuple[int, float]]:
        """The n most likely tokens (ids) under logits [|A|] with their log q."""
        top = logits.topk(min(n, int(torch.isfinite(logits).sum())))
        logq = top.values - logits.logsumexp(-1)
        return list(zip(self.active_ids[top.indices].tolist(), logq.tolist()))

    def tree(self) -> DraftTree:
        """The kept nodes renumbered 0..n-1 (parents before children); `slot_of`, `nodes` and `alternatives` follow
        the new numbering."""
        nodes = self.nodes
        keep = list(range(len(nodes)))
        if self.session.sampling.greedy and len(nodes) > self.budget:
            ranked = sorted(keep, key=lambda i: (-nodes[i].score, nodes[i].depth))
            keep = sorted(ranked[:self.budget])
        new_index = {old: new for new, old in enumerate(keep)}
        renumber = {-1: -1, **new_index}
        self.slot_of = {new_index[o]: s for o, s in self.slot_of.items() if o in new_index}
        self.alternatives = {renumber[p]: alt for p, alt in self.alternatives.items() if p in renumber}
        self.nodes = [_Node(nodes[i].token, renumber[nodes[i].parent], nodes[i].depth, nodes[i].score) for i in keep]
        probs = {renumber[p]: q for p, q in self.draft_probs.items() if p in renumber}
        return DraftTree(torch.tensor([n.token for n in self.nodes], dtype=torch.long),
                         torch.tensor([n.parent for n in self.nodes], dtype=torch.long), probs,
                         self.active_ids.clone() if probs else None)  # a snapshot: D may change after this step

