"""ActiveIds: the one routine that keeps A's ids, membership mask and sources in step with slot changes (the draft's
own A and the target's mirror of it)."""
import torch

from evospec.vocab.active import ActiveIds
from evospec.vocab.dynamic import SlotChange


def one_by_one(ids: list[int], changes: list[SlotChange]) -> tuple[list[int], dict[int, str]]:
    """The reference: changes applied one at a time to a list of dynamic ids."""
    ids, sources = list(ids), {}
    for c in changes:
        sources.pop(ids[c.slot], None)
        ids[c.slot] = c.token_id
        if c.token_id >= 0:
            sources[c.token_id] = c.source
    return ids, sources


def test_slot_changes_update_ids_mask_and_sources():
    static = [0, 1, 2]
    active = ActiveIds(torch.tensor(static + [-1, -1, -1]), num_static=3, vocab_size=16)
    first = [SlotChange(0, 10, -1, "statistical"), SlotChange(2, 11, -1, "semantic")]
    active.apply(first)
    # one reply may carry two updates: slot 0 changes twice, 11 moves from slot 2 to slot 1
    second = [SlotChange(0, 12, 10, "target"), SlotChange(2, -1, 11), SlotChange(1, 11, -1, "target"),
              SlotChange(0, 13, 12, "statistical")]
    active.apply(second)
    expected, sources = one_by_one([-1, -1, -1], first + second)
    assert active.row_ids.tolist() == static + expected == [0, 1, 2, 13, 11, -1]
    assert active.dynamic_ids == expected
    assert active.mask.nonzero()[:, 0].tolist() == [0, 1, 2, 11, 13]
    assert active.source_of == sources == {13: "statistical", 11: "target"}


def test_no_changes_change_nothing():
    active = ActiveIds(torch.tensor([4, 5, -1]), num_static=2, vocab_size=8)
    active.apply([])
    assert active.row_ids.tolist() == [4, 5, -1] and active.mask.nonzero()[:, 0].tolist() == [4, 5]
