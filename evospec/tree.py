"""The draft token tree exchanged between draft and target (a chain is a tree with one child per node)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from evospec.kernels.tree import tree_depths


@dataclass
class DraftTree:
    """One step's proposal.

    token_ids: [n] full-vocabulary ids. parents: [n] index of the parent node, -1 = child of the last committed token.
    Parents precede children; siblings are in the order they were drafted (for sampling: the without-replacement
    sampling order, which verification must follow).
    draft_probs: only when sampling: {node index or -1 (root): [|A|] draft distribution its children were drawn
    from}, over `active_ids` ([|A|] full ids; -1 = unused dynamic slot with zero probability).
    """
    token_ids: torch.Tensor
    parents: torch.Tensor
    draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)
    active_ids: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def depth(self) -> int:
        """Levels of this tree (0 = empty): the depth of its deepest node."""
        return int(tree_depths(self.parents).max()) if self.size else 0

    @classmethod
    def empty(cls) -> "DraftTree":
        return cls(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))

    def children(self) -> dict[int, list[int]]:
        """{parent index (-1 = root): [child indices in drafting order]}."""
        out: dict[int, list[int]] = {}
        for i, p in enumerate(self.parents.tolist()):
            out.setdefault(p, []).append(i)
        return out
