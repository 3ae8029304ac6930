"""Target side of the internal protocol: a `Drafter` that talks to a draft replica over one bidi stream, and the
pool that finds draft replicas and opens those streams.

The target drives: Start once, then per step one Outcome (accepted path, bonus, target-fed buffer candidates) and
one DraftToTarget back (the next tree + the buffer slot changes the draft applied before drafting it). The target
mirrors A from those changes, so misses and candidates are computed against exactly the A each tree used.
"""
from __future__ import annotations

import queue
import time
from collections.abc import Awaitable, Callable

import grpc
import torch

from evospec.engine.drafter import DraftRequest, feedback_for
from evospec.engine.stats import SpecStats
from evospec.engine.target import VerifiedStep
from evospec.errors import EvoSpecError
from evospec.services.common.convert import outcome_to_proto, start_to_proto, tree_from_proto
from evospec.services.config import INTERNAL_CHANNEL_OPTIONS
from evospec.services.protocol.v1 import speculation_pb2 as spec_pb
from evospec.services.protocol.v1 import speculation_pb2_grpc as spec_grpc
from evospec.tree import DraftTree
from evospec.vocab.registry import ActiveLayout


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
    def __init__(self, stub: spec_grpc.DraftStub, session_id: str, request: DraftRequest, mirror: ActiveSetMirror,
                 wants_candidates: bool, static_vocab_sha: str, timeout_s: float):
        self.mirror = mirror
        self.wants_candidates = wants_candidates
        self._feedback_seconds = 0.0  # target-side share of the buffer update (misses, candidates)
        self._requests: queue.Queue = queue.Queue()
        self._requests.put(start_to_proto(session_id, request))
        self._call = stub.Speculate(iter(self._requests.get, None), timeout=timeout_s)
        first = self._receive()
        if static_vocab_sha and first.static_vocab_sha and first.static_vocab_sha != static_vocab_sha:
            self.close()
            raise DraftStreamError(f"draft and target use different static vocabularies "
                                   f"({first.static_vocab_sha} vs {static_vocab_sha})")
        self._next = self._tree(first)

    def _receive(self) -> spec_pb.DraftToTarget:
        try:
            msg = next(self._call)
        except grpc.RpcError as err:  # draft failure, deadline, cancellation
            raise DraftStreamError(f"draft: {err.details()}", err.code().name) from None
        self.mirror.apply(msg.buffer_changes)  # applied by the draft before it drafted this tree
        self._changes = sum(1 for c in msg.buffer_changes if c.token_id >= 0)
        self._last_reply = msg
        return msg

    def _tree(self, msg: spec_pb.DraftToTarget) -> DraftTree:
        return tree_from_proto(msg, self.mirror.row_ids.clone() if msg.draft_probs else None)

    def propose(self) -> DraftTree:
        return self._next

    def observe(self, verified: VerifiedStep, stats: SpecStats) -> None:
        candidates = {}
        if self.mirror.restricted:
            start = time.perf_counter()
            candidates = feedback_for(verified, self.mirror.mask, self.wants_candidates, stats).candidates
            self._feedback_seconds += time.perf_counter() - start
        self._requests.put(outcome_to_proto(verified.result, candidates))
        self._next = self._tree(self._receive())
        stats.buffer_updates += self._changes  # applied on the draft side, before it drafted the next tree
        stats.draft_head_seconds = self._last_reply.head_seconds
        stats.buffer_update_seconds = self._feedback_seconds + self._last_reply.buffer_update_seconds

    def close(self) -> None:
        self._requests.put(spec_pb.TargetToDraft(outcome=spec_pb.Outcome(finished=True)))
        self._requests.put(None)
        self._call.cancel()  # frees the draft session at once, even if it is mid-tree


class RemoteDraftPool:
    """Where the target's speculative generations get their drafters: today one draft replica, found once through
    `address` (an async callable, e.g. a Serve handle call), reached over one shared gRPC channel."""

    def __init__(self, address: Callable[[], Awaitable[str]], timeout_s: float):
        self._address = address
        self.timeout_s = timeout_s
        self._channel: grpc.Channel | None = None
        self._stub: spec_grpc.DraftStub | None = None

    async def connect(self) -> None:
        if self._channel is None:
            self._channel = grpc.insecure_channel(await self._address(), options=INTERNAL_CHANNEL_OPTIONS)
            self._stub = spec_grpc.DraftStub(self._channel)

    def open(self, session_id: str, request: DraftRequest, layout: ActiveLayout, vocab_size: int,
             static_vocab_sha: str) -> RemoteDrafter:
        """Open a session's stream (blocking: called from the generation's worker thread, after `connect`); the
        draft must use the static artifact `static_vocab_sha` names."""
        if self._stub is None:
            raise RuntimeError("RemoteDraftPool.open before connect()")
        mirror = ActiveSetMirror(layout.static_ids, layout.dynamic_size, vocab_size)
        return RemoteDrafter(self._stub, session_id, request, mirror, layout.target_feedback, static_vocab_sha,
                             self.timeout_s)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
