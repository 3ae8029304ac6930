"""Target side of the internal protocol: `RemoteMuxDrafter`, the scheduler's drafts over one multiplexed stream per
target replica (SpeculateBatch); `RemoteDrafter`, a per-request loop's draft over one stream per generation
(Speculate); and the pool that finds the draft replica and holds the channel.

The target drives: it opens sessions with the prompt, sends each verified step's outcome (accepted path, bonus,
target-fed buffer candidates) and gets trees back with the buffer slot changes the draft applied before drafting
them. The target mirrors A from those changes, so misses and candidates are computed against exactly the A each
tree used.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Awaitable, Callable

import grpc
import torch

from evospec.config import SpecParams, TreeParams
from evospec.engine.budget import tree_depth
from evospec.engine.drafter import DraftRequest, feedback_for
from evospec.engine.stats import SpecStats
from evospec.engine.target import VerifiedStep
from evospec.errors import EvoSpecError
from evospec.kernels.tree import tree_depths
from evospec.services.common.convert import (
    outcome_to_proto,
    session_op_to_proto,
    start_to_proto,
    tree_from_proto,
)
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
    """One generation's end of a per-generation `Speculate` stream (the per-request loop's remote draft). Sending
    never waits: Start on creation and each Outcome in `observe`; `propose` reads the draft's reply."""

    def __init__(self, stub: spec_grpc.DraftStub, session_id: str, request: DraftRequest, mirror: ActiveSetMirror,
                 wants_candidates: bool, static_vocab_sha: str, timeout_s: float):
        self.mirror = mirror
        self.wants_candidates = wants_candidates
        self.static_vocab_sha = static_vocab_sha
        self._feedback_seconds = 0.0  # target-side share of the buffer update (misses, candidates)
        self._requests: queue.Queue = queue.Queue()
        self._requests.put(start_to_proto(session_id, request))
        self._call = stub.Speculate(iter(self._requests.get, None), timeout=timeout_s)
        self._first = True
        self._stats: SpecStats | None = None  # the generation's statistics, updated as replies arrive

    def _receive(self) -> spec_pb.DraftToTarget:
        try:
            msg = next(self._call)
        except grpc.RpcError as err:  # draft failure, deadline, cancellation
            raise DraftStreamError(f"draft: {err.details()}", err.code().name) from None
        if self._first:
            self._first = False
            if self.static_vocab_sha and msg.static_vocab_sha and msg.static_vocab_sha != self.static_vocab_sha:
                self.close()
                raise DraftStreamError(f"draft and target use different static vocabularies "
                                       f"({msg.static_vocab_sha} vs {self.static_vocab_sha})")
        self.mirror.apply(msg.buffer_changes)  # applied by the draft before it drafted this tree
        if self._stats is not None:
            self._stats.buffer_updates += sum(1 for c in msg.buffer_changes if c.token_id >= 0)
            self._stats.draft_head_seconds = msg.head_seconds
            self._stats.buffer_update_seconds = self._feedback_seconds + msg.buffer_update_seconds
        return msg

    def propose(self) -> DraftTree:
        """The tree for the current state (waits for the draft's reply to Start or to the last outcome)."""
        msg = self._receive()
        return tree_from_proto(msg, self.mirror.row_ids.clone() if msg.draft_probs else None)

    def observe(self, verified: VerifiedStep, stats: SpecStats) -> None:
        """Send the step's outcome; the draft commits it and drafts the next tree meanwhile."""
        self._stats = stats
        candidates = {}
        if self.mirror.restricted:
            start = time.perf_counter()
            candidates = feedback_for(verified, self.mirror.mask, self.wants_candidates, stats).candidates
            self._feedback_seconds += time.perf_counter() - start
        self._requests.put(outcome_to_proto(verified.result, candidates))

    def close(self) -> None:
        self._requests.put(spec_pb.TargetToDraft(outcome=spec_pb.Outcome(finished=True)))
        self._requests.put(None)
        self._call.cancel()  # frees the draft session at once, even if it is mid-tree


class _MuxStream:
    """One SpeculateBatch call: messages go out through a queue (sending never waits), replies come in on a reader
    thread, and `receive` waits for the next one at most `timeout_s`."""

    def __init__(self, stub: spec_grpc.DraftStub, timeout_s: float):
        self.timeout_s = timeout_s
        self._out: queue.Queue = queue.Queue()
        self._in: queue.Queue = queue.Queue()
        self._call = stub.SpeculateBatch(iter(self._out.get, None))
        self.outstanding = 0  # messages sent whose reply has not been read
        threading.Thread(target=self._read, name="draft-mux-reader", daemon=True).start()

    def _read(self) -> None:
        try:
            for msg in self._call:
                self._in.put(msg)
            self._in.put(DraftStreamError("draft: stream ended", "UNAVAILABLE"))
        except grpc.RpcError as err:
            self._in.put(DraftStreamError(f"draft: {err.details()}", err.code().name))

    def send(self, msg: spec_pb.TargetStep) -> None:
        self._out.put(msg)
        self.outstanding += 1

    def receive(self) -> spec_pb.DraftStep:
        try:
            item = self._in.get(timeout=self.timeout_s)
        except queue.Empty:
            raise DraftStreamError(f"draft: no reply within {self.timeout_s:g}s", "DEADLINE_EXCEEDED") from None
        if isinstance(item, Exception):
            raise item
        self.outstanding -= 1
        return item

    def close(self) -> None:
        self._out.put(None)
        self._call.cancel()


class RemoteMuxDrafter:
    """The batching scheduler's drafts over one multiplexed stream per target replica (SpeculateBatch): per engine
    step one TargetStep (every session's opens, outcomes and closes, and the trees wanted at the chosen depth) and
    one DraftStep back with every tree, drafted on the replica with one packed forward per tree level.
    Outcomes of a step are sent at its end (`flush`) without waiting, and read back with the next step's trees."""

    def __init__(self, pool: "RemoteDraftPool", layout_of: Callable[[SpecParams], ActiveLayout], vocab_size: int,
                 static_vocab_sha: str, step_timeout_s: float = 30.0):
        self.pool, self.layout_of = pool, layout_of
        self.vocab_size, self.static_vocab_sha = vocab_size, static_vocab_sha
        self.step_timeout_s = step_timeout_s  # a draft silent for longer fails its sessions (the others go on)
        self.mirrors: dict[str, ActiveSetMirror] = {}
        self._wants_candidates: dict[str, bool] = {}
        self._stats: dict[str, SpecStats] = {}
        self._feedback_seconds: dict[str, float] = {}
        self._ops: list[spec_pb.SessionOp] = []
        self._errors: dict[str, Exception] = {}  # sessions that failed in a reply no step has collected yet
        self._drafted: set[str] = set()
        self._stream: _MuxStream | None = None

    def open(self, key: str, request: DraftRequest) -> None:
        layout = self.layout_of(request.spec)
        self.mirrors[key] = ActiveSetMirror(layout.static_ids, layout.dynamic_size, self.vocab_size)
        self._wants_candidates[key] = layout.target_feedback
        self._feedback_seconds[key] = 0.0
        self._ops.append(session_op_to_proto(key, "start", request))

    def propose(self, requests: dict[str, TreeParams], prefills: dict[str, int]) -> dict[str, DraftTree | Exception]:
        work = [spec_pb.DraftWork(session_id=k, depth=tree_depth(p), prefill_tokens=prefills.get(k, 0))
                for k, p in requests.items()]
        work += [spec_pb.DraftWork(session_id=k, prefill_tokens=n) for k, n in prefills.items() if k not in requests]
        self._drafted = set(requests)
        out: dict[str, DraftTree | Exception] = {}
        try:
            reply = self._exchange(spec_pb.TargetStep(ops=self._take_ops(), work=work))
        except DraftStreamError as exc:
            return {key: exc for key in self.mirrors}  # the stream is gone, and every session on it
        for session in reply.sessions:
            key = session.session_id
            if session.has_tree and key in requests and key in self.mirrors:
                mirror = self.mirrors[key]
                try:
                    out[key] = checked_tree(tree_from_proto(
                        session.reply, mirror.row_ids.clone() if session.reply.draft_probs else None), requests[key])
                except ValueError as exc:  # a malformed tree fails its session, never the batch
                    out[key] = DraftStreamError(f"draft: {exc}", "INTERNAL")
        out.update(self._errors)
        self._errors = {}
        return out

    def observe(self, steps: dict[str, tuple[VerifiedStep, SpecStats]]) -> None:
        for key, (verified, stats) in steps.items():
            self._stats[key] = stats
            candidates = {}
            if self.mirrors[key].restricted and key in self._drafted:
                start = time.perf_counter()
                candidates = feedback_for(verified, self.mirrors[key].mask, self._wants_candidates[key],
                                          stats).candidates
                self._feedback_seconds[key] += time.perf_counter() - start
            self._ops.append(session_op_to_proto(key, "outcome", result=verified.result, candidates=candidates))

    def flush(self) -> None:
        """Send the step's outcomes and closes now (the replica commits them while the target goes on). Stream
        errors surface at the next exchange."""
        self._drafted = set()
        if self._ops:
            self._connected().send(spec_pb.TargetStep(ops=self._take_ops()))

    def close(self, key: str) -> None:
        if self.mirrors.pop(key, None) is not None:
            self._ops.append(session_op_to_proto(key, "close"))
        for table in (self._wants_candidates, self._stats, self._feedback_seconds, self._errors):
            table.pop(key, None)

    def shutdown(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def _take_ops(self) -> list[spec_pb.SessionOp]:
        ops, self._ops = self._ops, []
        return ops

    def _connected(self) -> _MuxStream:
        if self._stream is None:
            self._stream = _MuxStream(self.pool.stub, self.step_timeout_s)
        return self._stream

    def _exchange(self, msg: spec_pb.TargetStep) -> spec_pb.DraftStep:
        """Send, then read every reply still owed (earlier flushes: their buffer changes and errors are applied in
        order); returns the reply to `msg`. A broken stream is dropped, so the next step opens a new one."""
        stream = self._connected()
        try:
            stream.send(msg)
            while True:
                reply = stream.receive()
                self._apply(reply)
                if stream.outstanding == 0:
                    return reply
        except DraftStreamError:
            self.shutdown()
            raise

    def _apply(self, reply: spec_pb.DraftStep) -> None:
        if self.static_vocab_sha and reply.static_vocab_sha and reply.static_vocab_sha != self.static_vocab_sha:
            raise DraftStreamError(f"draft and target use different static vocabularies "
                                   f"({reply.static_vocab_sha} vs {self.static_vocab_sha})")
        for session in reply.sessions:
            key = session.session_id
            if key not in self.mirrors:
                continue  # closed meanwhile
            if session.error:
                self._errors[key] = DraftStreamError(f"draft: {session.error}", session.error_code or "INTERNAL")
                continue
            self.mirrors[key].apply(session.reply.buffer_changes)
            stats = self._stats.get(key)
            if stats is not None:
                stats.buffer_updates += sum(1 for c in session.reply.buffer_changes if c.token_id >= 0)
                stats.draft_head_seconds = session.reply.head_seconds
                stats.buffer_update_seconds = self._feedback_seconds[key] + session.reply.buffer_update_seconds


def checked_tree(tree: DraftTree, params: TreeParams) -> DraftTree:
    """A tree from another process, checked before the target forwards it: shapes agree, parents precede children,
    and it is no larger than the shape asked for."""
    if tree.parents.shape != tree.token_ids.shape:
        raise ValueError(f"tree has {tree.size} tokens but {tree.parents.shape[0]} parents")
    if tree.size > params.max_nodes:
        raise ValueError(f"tree of {tree.size} nodes; at most {params.max_nodes} were asked for")
    if tree.size and int(tree_depths(tree.parents).max()) > tree_depth(params):
        raise ValueError(f"tree deeper than the {tree_depth(params)} levels asked for")
    return tree


class RemoteDraftPool:
    """Where the target's speculative generations get their drafters: today one draft replica, found once through
    `address` (an async callable, e.g. a Serve handle call), reached over one shared gRPC channel."""

    def __init__(self, address: Callable[[], Awaitable[str]], timeout_s: float):
        self._address = address
        self.timeout_s = timeout_s
        self._channel: grpc.Channel | None = None
        self._stub: spec_grpc.DraftStub | None = None

    @property
    def stub(self) -> spec_grpc.DraftStub:
        if self._stub is None:
            raise RuntimeError("RemoteDraftPool used before connect()")
        return self._stub

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
