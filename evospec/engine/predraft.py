"""Pre-drafting: what a decoupled draft does while the target verifies its tree (greedy requests).

Once a tree T has gone to the target, the step's outcome is one of: the accepted path ends at a node n of T (or at
its root), and the target appends its own token b there, which under greedy is never one of n's children in T. The
draft ranks these outcomes by its own probability of them, score(n) + log q_n(b) (the path's cumulative log q, then
b's), and drafts the next tree for the M likeliest (`hypotheses`). When the real outcome arrives and is one of them,
that tree is answered at once; otherwise the work is dropped and the tree drafted as usual. A tree only proposes,
so the output stays the target's either way.

KV layout in the session's own cache while T is in flight (L = committed length, F = nodes a tree of this shape
forwards, D = its depth):

    [0, L) committed | [L, L+F) T's forwarded nodes | D+2 spare | T's unforwarded nodes | M x (b, its tree's F)

On a hit the accepted path and b are committed (compacted into [L, L+j+1): the spare slots guarantee it never
overwrites the hypothesis' nodes) and its tree's nodes are moved right after them, which is exactly the state a
normal draft step leaves. The dynamic buffer's update for a hit outcome waits until that tree has been sent (it
was drafted with the vocabulary before the update; the target mirrors the changes in the order they are applied).
"""
from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from evospec.config import TreeParams
from evospec.tree import DraftTree
from evospec.verify import VerifyResult

if TYPE_CHECKING:
    from evospec.engine.draft import TreeBuilder


def forwarded_nodes(params: TreeParams) -> int:
    """Nodes a tree of this shape forwards while it is built (its last level never is)."""
    return (params.levels - 1) * params.width


def region_start(committed: int, params: TreeParams) -> int:
    """First slot of pre-drafting's scratch: after the tree in flight and enough spare slots that committing any
    outcome (at most D + 1 tokens) never reaches it."""
    return committed + forwarded_nodes(params) + params.levels + 2


def predraft_slots(params: TreeParams, hypotheses: int) -> int:
    """Extra KV slots a session needs to pre-draft `hypotheses` outcomes of trees of this shape."""
    if not hypotheses:
        return 0
    return region_start(0, params) + params.max_nodes + hypotheses * (1 + forwarded_nodes(params))


@dataclass
class Hypothesis:
    """A predicted outcome of the tree in flight and the next tree drafted for it."""
    path: list[int]  # the tree's nodes accepted, root to end
    bonus: int  # the target's token after them
    bonus_slot: int  # where b's KV was written
    builder: "TreeBuilder"  # the next tree, built from the path and b
    tree: DraftTree | None = None


def likely_outcomes(tree: "TreeBuilder", m: int) -> list[tuple[int, int]]:
    """The m likeliest (node, bonus token) outcomes of a built tree under the draft's own probabilities; node -1 =
    nothing accepted. Needs the alternatives of every node (TreeBuilder(alternatives=...), and the last level's
    after its forward)."""
    children: dict[int, set[int]] = defaultdict(set)
    for node in tree.nodes:
        children[node.parent].add(node.token)
    scored = []
    for node, alternatives in tree.alternatives.items():
        path_score = 0.0 if node < 0 else tree.nodes[node].score
        scored += [(path_score + logq, node, token) for token, logq in alternatives if token not in children[node]]
    return [(node, token) for _, node, token in heapq.nlargest(m, scored)]


def path_to(tree: "TreeBuilder", node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = tree.nodes[node].parent
    return path[::-1]


@dataclass
class PredraftState:
    """One session's pre-drafting: the tree in flight, the next trees drafted for its likeliest outcomes, the one
    that matched the real outcome, and the buffer update that waits for it to be sent."""
    hypotheses: int  # M
    in_flight: "TreeBuilder | None" = None
    options: list[Hypothesis] = field(default_factory=list)
    ready: Hypothesis | None = None
    deferred: tuple | None = None  # (result, feedback) of a hit outcome, for the vocabulary once its tree is sent

    def sent(self, builder: "TreeBuilder") -> None:
        self.in_flight, self.options, self.ready = builder, [], None

    def match(self, result: VerifyResult) -> bool:
        """Whether the step's real outcome is one that was pre-drafted (it becomes `ready`)."""
        self.in_flight, self.ready = None, None
        options, self.options = self.options, []
        accepted, bonus = list(result.accepted_nodes), result.committed_tokens[-1]
        self.ready = next((h for h in options if h.path == accepted and h.bonus == bonus), None)
        return self.ready is not None
