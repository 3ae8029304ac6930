"""Target side of the internal protocol: a `Drafter` that talks to the draft replica over one bidi stream.

The target drives: Start once, then per step one Outcome (accepted path, bonus, target-fed buffer candidates) and
one DraftToTarget back (the next tree + the buffer slot changes the draft applied before drafting it). The target
mirrors A from those changes, so misses and candidates are computed against exactly the A each tree used.
"""
from __future__ import annotations

import queue

import grpc
import torch

from evospec.api.evospec.v1 import speculation_pb2 as spec_pb
from evospec.api.evospec.v1 import speculation_pb2_grpc as spec_grpc
from evospec.config import SamplingParams, SpecParams
from evospec.engine.drafter import feedback_for
from evospec.engine.stats import SpecStats
from evospec.engine.target import VerifiedStep
from evospec.errors import EvoSpecError
from evospec.tree import DraftTree
from evospec.vocab.registry import ActiveLayout
from services.common.convert import outcome_to_proto, sampling_to_proto, spec_to_proto, tree_from_proto


class ActiveSetMirror:
    """The target's copy of the draft's A: static prefix + dynamic slots, kept in sync by slot changes."""

    def __init__(self, static_ids: torch.Tensor | None, dynamic_size: int, vocab_size: int):
        if static_ids is None:  # sd: A is the whole vocabulary
            self.row_ids = torch.arange(vocab_size)
            self.restricted = False
        else:
            self.row_ids = torch.cat([static_ids, torch.full((dynamic_size,), -1, dtype=torch.long)])
            self.restricted = True
        self.num_static = 0 if static_ids is None else static_ids.shape[0]
        self.mask = torch.zeros(vocab_size, dtype=torch.bool)
        self.mask[self.row_ids[self.row_ids >= 0]] = True

    def apply(self, changes) -> None:
        for ch in changes:
            slot = self.num_static + ch.slot
            old = int(self.row_ids[slot])
            if old >= 0:
                self.mask[old] = False
            self.row_ids[slot] = ch.token_id
            if ch.token_id >= 0:
                self.mask[ch.token_id] = True


class DraftStreamError(EvoSpecError):
    """The draft side of the stream failed; carries its gRPC status name (picklable, unlike grpc.RpcError)."""

    def __init__(self, message: str, code_name: str = "INTERNAL"):
        super().__init__(message)
        self.code_name = code_name

    def __reduce__(self):
        return type(self), (str(self), self.code_name)


class RemoteDrafter:
    def __init__(self, channel: grpc.Channel, session_id: str, prompt_ids: list[int], sampling: SamplingParams,
                 spec: SpecParams, max_len: int, seed: int, layout: ActiveLayout, vocab_size: int,
                 static_vocab_sha: str, timeout_s: float):
        self.wants_candidates = layout.target_feedback
        self.mirror = ActiveSetMirror(layout.static_ids, layout.dynamic_size, vocab_size)
        self._requests: queue.Queue = queue.Queue()
        self._requests.put(spec_pb.TargetToDraft(start=spec_pb.StartSession(
            session_id=session_id, prompt_token_ids=prompt_ids, sampling=sampling_to_proto(sampling),
            spec=spec_to_proto(spec), seed=seed + 1, max_len=max_len)))
        self._call = spec_grpc.DraftStub(channel).Speculate(iter(self._requests.get, None), timeout=timeout_s)
        self._first_sha = ""  # the draft names its static artifact in its first reply
        self._next = self._receive()
        if static_vocab_sha and self._first_sha and self._first_sha != static_vocab_sha:
            self.close()
            raise DraftStreamError(f"draft and target use different static vocabularies "
                                   f"({self._first_sha} vs {static_vocab_sha})")

    def _receive(self) -> DraftTree:
        try:
            msg = next(self._call)
        except grpc.RpcError as err:  # draft failure, deadline, cancellation
            raise DraftStreamError(f"draft: {err.details()}", err.code().name) from None
        self._first_sha = self._first_sha or msg.static_vocab_sha
        self.mirror.apply(msg.buffer_changes)  # applied by the draft before it drafted this tree
        self._changes = len([c for c in msg.buffer_changes if c.token_id >= 0])
        return tree_from_proto(msg, self.mirror.row_ids.clone() if msg.draft_probs else None)

    def propose(self) -> DraftTree:
        return self._next

    def observe(self, verified: VerifiedStep, stats: SpecStats) -> None:
        candidates, misses = {}, 0
        if self.mirror.restricted:
            fb = feedback_for(verified, self.mirror.mask, self.wants_candidates, stats)
            candidates, misses = fb.candidates, fb.misses
        self._requests.put(outcome_to_proto(verified.result, candidates, misses))
        self._next = self._receive()
        stats.buffer_updates += self._changes  # applied on the draft side, before it drafted the next tree

    def close(self) -> None:
        self._requests.put(spec_pb.TargetToDraft(outcome=spec_pb.Outcome(finished=True)))
        self._requests.put(None)
        self._call.cancel()  # frees the draft session at once, even if it is mid-tree
