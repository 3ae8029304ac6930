"""Target side of the internal protocol: `RemoteMuxDrafter`, the scheduler's drafts over one multiplexed stream per
draft replica (SpeculateBatch), spread over the healthy replicas that `DraftReplicas` (draft_link.py) finds.

The target drives: it opens sessions with the prompt, sends each verified step's outcome (accepted path, bonus,
target-fed buffer candidates) and gets trees back with the buffer slot changes the draft applied before drafting
them. The target mirrors A from those changes, so misses and candidates are computed against exactly the A each
tree used.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterable

import grpc
import torch

from evospec.adapt.signal import teacher_signal
from evospec.config import SpecParams, TreeParams
from evospec.engine.drafter import DraftRequest, FeedbackRequest, feedbacks_for
from evospec.engine.profile import StepProfile
from evospec.engine.stats import SpecStats
from evospec.engine.target import VerifiedStep
from evospec.errors import EvoSpecError
from evospec.services.common.convert import session_op_to_proto, tree_from_proto
from evospec.services.protocol.v1 import speculation_pb2 as spec_pb
from evospec.services.protocol.v1 import speculation_pb2_grpc as spec_grpc
from evospec.services.target.draft_link import DraftReplica, DraftReplicas
from evospec.tree import DraftTree
from evospec.vocab.active import ActiveIds
from evospec.vocab.registry import ActiveLayout


class ActiveSetMirror(ActiveIds):
    """The target's copy of the draft's A: static prefix + dynamic slots, kept in sync by the slot changes of the
    draft's replies (`ActiveIds.apply`, the routine the draft's own A uses), with the retrieval source of each dynamic
    id (for the buffer-hit statistics)."""

    def __init__(self, static_ids: torch.Tensor | None, dynamic_size: int, vocab_size: int,
                 device: torch.device | str = "cpu"):
        """device: the target model's, where the step's feedback reads A's membership (evospec/vocab/retrieval.py)."""
        self.restricted = static_ids is not None
        if static_ids is None:  # a full head: A is the whole vocabulary, every row static
            super().__init__(torch.arange(vocab_size, device=device), vocab_size, vocab_size)
        else:
            row_ids = torch.cat([static_ids, torch.full((dynamic_size,), -1, dtype=torch.long)]).to(device)
            super().__init__(row_ids, static_ids.shape[0], vocab_size)


class DraftStreamError(EvoSpecError):
    """The draft side of the stream failed; carries its gRPC status name (picklable, unlike grpc.RpcError).
    `retryable` is False for what a reconnect cannot fix (the draft refused the request, or uses another static
    vocabulary): the scheduler then never resumes that generation's speculation."""

    PERMANENT = frozenset({"INVALID_ARGUMENT", "FAILED_PRECONDITION", "UNIMPLEMENTED"})

    def __init__(self, message: str, code_name: str = "INTERNAL"):
        super().__init__(message)
        self.code_name = code_name

    @property
    def retryable(self) -> bool:
        return self.code_name not in self.PERMANENT

    def __reduce__(self):
        return type(self), (str(self), self.code_name)


def stream_error(err: grpc.RpcError) -> DraftStreamError:
    """A failed call as the statistics may show it (SpecStats.fallback_reason reaches clients): the status, and the
    details only for statuses our draft server sets with a public message (grpc's own can name addresses)."""
    code = err.code()
    public = code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                      grpc.StatusCode.FAILED_PRECONDITION)
    return DraftStreamError(f"draft: {err.details()}" if public else f"draft stream failed ({code.name})", code.name)


def vocab_mismatch(draft_sha: str, target_sha: str) -> DraftStreamError:
    return DraftStreamError(f"draft and target use different static vocabularies ({draft_sha} vs {target_sha})",
                            "FAILED_PRECONDITION")


class _MuxStream:
    """One SpeculateBatch call: messages go out through a queue (sending never waits), replies come in on a reader
    thread, and `receive` waits for the next one until a deadline."""

    def __init__(self, stub: spec_grpc.DraftStub):
        self._out: queue.Queue = queue.Queue()
        self._in: queue.Queue = queue.Queue()
        self._call = stub.SpeculateBatch(iter(self._out.get, None))
        self.outstanding = 0  # messages sent whose reply has not been read
        self.dead = False  # the call ended (error or end of stream): nothing more will arrive
        self.last_arrival = 0.0  # time.monotonic() when the last reply read had arrived
        threading.Thread(target=self._read, name="draft-mux-reader", daemon=True).start()

    def _read(self) -> None:
        try:
            for msg in self._call:
                self._in.put((msg, time.monotonic()))
            error = DraftStreamError("draft: stream ended", "UNAVAILABLE")
        except grpc.RpcError as err:
            error = stream_error(err)
        self.dead = True
        self._in.put((error, time.monotonic()))

    def send(self, msg: spec_pb.TargetStep) -> None:
        self._out.put(msg)
        self.outstanding += 1

    def receive(self, deadline: float) -> spec_pb.DraftStep:
        try:
            item, self.last_arrival = self._in.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise DraftStreamError("draft: no reply within the step deadline", "DEADLINE_EXCEEDED") from None
        if isinstance(item, Exception):
            raise item
        self.outstanding -= 1
        return item

    def close(self) -> None:
        self._out.put(None)
        self._call.cancel()


class _Link:
    """The multiplexed stream to one draft replica, the sessions it holds and the ops queued for it.

    Outcomes of steps a session did not draft only append tokens on the replica; they wait in `ops` for the next
    message that goes out anyway (a tree, a start, a close, a drafted step's outcome), so a replica whose sessions
    the budget does not draft for gets no message and does no work per step (on a CPU it shares with the target,
    every message costs both processes a wake-up). They wait at most `APPENDS_MAX_OPS` ops and `APPENDS_MAX_S`
    seconds: the bound on this queue, and a message often enough that the replica's idle watch (`idle_timeout_s`,
    300 s by default) never takes a busy stream for an idle one."""

    APPENDS_MAX_OPS = 64
    APPENDS_MAX_S = 10.0

    def __init__(self, replica: DraftReplica):
        self.replica = replica
        self.stream = _MuxStream(replica.stub)
        self.sessions: set[str] = set()
        self.ops: list[spec_pb.SessionOp] = []
        self.urgent = False  # `ops` holds more than appends: send them with this step
        self.appends_since: float | None = None  # time.monotonic() when the oldest waiting append was queued
        self.teacher_top_k = 0  # > 0 once the replica said it adapts online (DraftStep.teacher_top_k)
        self.owed_prefill = 0  # prompt tokens sent with `prefill` whose reply has not been read yet

    def queue(self, op: spec_pb.SessionOp, append_only: bool = False) -> None:
        """Queue an op for the next message; `append_only`: an outcome of a step its session did not draft."""
        self.ops.append(op)
        if not append_only:
            self.urgent = True
        elif self.appends_since is None:
            self.appends_since = time.monotonic()

    def due(self) -> bool:
        """Whether the queued ops must go out with this step even if no work does."""
        return self.urgent or len(self.ops) >= self.APPENDS_MAX_OPS or (
            self.appends_since is not None and time.monotonic() - self.appends_since >= self.APPENDS_MAX_S)

    def take_ops(self) -> list[spec_pb.SessionOp]:
        ops, self.ops = self.ops, []
        self.urgent, self.appends_since = False, None
        return ops


class RemoteMuxDrafter:
    """The batching scheduler's drafts over one multiplexed stream per draft replica (SpeculateBatch): per engine
    step one TargetStep per replica (its sessions' opens, outcomes and closes, and the trees wanted at the chosen
    depth) and one DraftStep back with its trees, drafted with one packed forward per tree level. Replicas draft in
    parallel; a new session goes to the healthy replica holding the fewest.

    A replica that breaks its stream, or whose reply misses the step deadline, is marked failed (DraftReplicas probes
    it before it takes sessions again) and only its sessions get an error: the scheduler runs them target-only and
    later resumes them on a healthy replica. Outcomes of a step are sent at its end (`flush`) without waiting, and
    read back with the next step's trees.

    A session starts on its replica with the first work it is given (a tree or a catch-up), over its context at that
    moment (the prompt and the tokens committed since, as a resumed session starts): until then the target only
    keeps its context here, so a request the budget never drafts for (on a CPU, most of them) costs the draft
    replica no start (its vocabulary fill and KV allocation, which ran during the target's prefill on the cores the
    two share), no appends and no close."""

    def __init__(self, replicas: DraftReplicas, layout_of: Callable[[SpecParams], ActiveLayout], vocab_size: int,
                 static_vocab_sha: str, device: torch.device | str = "cpu", overlap_prefill: bool | None = None):
        """device: the target model's; trees arrive there (services/common/convert.tree_from_proto).
        overlap_prefill: `prefill` sends catch-up work without waiting, so the draft prefills while the target runs
        its step. None = only when the target runs on a GPU: on a CPU whose cores the draft replica shares, the two
        compete for them (measured on 2 cores, real pair: evospec ran 1.02-1.05x ar with overlap, 1.2x without)."""
        self.replicas, self.layout_of, self.device = replicas, layout_of, device
        self.overlap_prefill = torch.device(device).type != "cpu" if overlap_prefill is None else overlap_prefill
        self.vocab_size, self.static_vocab_sha = vocab_size, static_vocab_sha
        self.mirrors: dict[str, ActiveSetMirror] = {}
        self._wants_candidates: dict[str, bool] = {}
        self._stats: dict[str, SpecStats] = {}
        self._feedback_seconds: dict[str, float] = {}
        self._errors: dict[str, Exception] = {}  # sessions that failed in a reply no step has collected yet
        self._drafted: set[str] = set()
        self._links: dict[str, _Link] = {}  # replica address -> live stream
        self._home: dict[str, _Link] = {}  # session key -> the link holding it
        self._unstarted: dict[str, DraftRequest] = {}  # opened here, not yet on its replica: the context so far
        self.profile = StepProfile()  # the scheduler shares its own: the draft span's parts

    def available(self) -> bool:
        """Whether a new session could be opened now (some replica is healthy)."""
        return bool(self.replicas.healthy())

    def open(self, key: str, request: DraftRequest) -> None:
        healthy = self.replicas.healthy()
        if not healthy:
            raise DraftStreamError("draft: no draft replica is reachable", "UNAVAILABLE")
        self._drop_idle_links(healthy)
        replica = min(healthy, key=lambda r: len(self._links[r.address].sessions) if r.address in self._links else 0)
        link = self._links.get(replica.address)
        if link is None:
            link = self._links[replica.address] = _Link(replica)
        layout = self.layout_of(request.spec)
        self.mirrors[key] = ActiveSetMirror(layout.static_ids, layout.dynamic_size, self.vocab_size, self.device)
        self._wants_candidates[key] = layout.target_feedback
        self._feedback_seconds[key] = 0.0
        self._home[key] = link
        link.sessions.add(key)
        self._unstarted[key] = dataclasses.replace(request, prompt_ids=list(request.prompt_ids))

    def _start_on_replicas(self, keys: Iterable[str]) -> None:
        """Queue the start of each of `keys` not started yet, over its context so far, ahead of its first work."""
        for key in keys:
            request = self._unstarted.pop(key, None)
            if request is None:
                continue
            link = self._home[key]
            if link.stream.dead and all(k in self._unstarted for k in link.sessions - {key}):
                # the replica closed it as idle (idle_timeout_s) while it held no started session: nothing is lost
                link.stream.close()
                link.stream, link.owed_prefill = _MuxStream(link.replica.stub), 0
            link.queue(session_op_to_proto(key, "start", request))

    def prefill(self, prefills: dict[str, int]) -> dict[str, Exception]:
        """Catch-up work alone (no tree this step): sent now, not waited for. The replica prefills while the target
        runs its step, and the reply is read with the next exchange (the stream keeps the order, so a tree asked
        for later is drafted over the prefilled context). Without `overlap_prefill`, a step like any other."""
        if not self.overlap_prefill:
            return {key: value for key, value in self.propose({}, prefills).items() if isinstance(value, Exception)}
        out: dict[str, Exception] = {}
        work: dict[_Link, list[spec_pb.DraftWork]] = {}
        self._start_on_replicas(key for key in prefills if key in self._home)
        for key, n in prefills.items():
            if key not in self._home:
                out[key] = DraftStreamError("draft: session lost with its replica", "UNAVAILABLE")
                continue
            work.setdefault(self._home[key], []).append(spec_pb.DraftWork(session_id=key, prefill_tokens=n))
        with self.profile.span("draft.encode"):
            for link, items in work.items():
                link.stream.send(spec_pb.TargetStep(ops=link.take_ops(), work=items))
                link.owed_prefill += sum(w.prefill_tokens for w in items)
        out.update(self._errors)
        self._errors = {}
        return out

    def propose(self, requests: dict[str, TreeParams], prefills: dict[str, int]) -> dict[str, DraftTree | Exception]:
        self._drafted = set(requests)
        out: dict[str, DraftTree | Exception] = {}
        for key in [*requests, *prefills]:
            if key not in self._home:  # defensive: a session whose replica failed is never asked for work
                out[key] = DraftStreamError("draft: session lost with its replica", "UNAVAILABLE")
        requests = {k: v for k, v in requests.items() if k in self._home}
        prefills = {k: v for k, v in prefills.items() if k in self._home}
        self._start_on_replicas([*requests, *prefills])
        work: dict[_Link, list[spec_pb.DraftWork]] = {}
        for key, params in requests.items():
            work.setdefault(self._home[key], []).append(
                spec_pb.DraftWork(session_id=key, depth=params.levels, prefill_tokens=prefills.get(key, 0)))
        for key, n in prefills.items():
            if key not in requests:
                work.setdefault(self._home[key], []).append(spec_pb.DraftWork(session_id=key, prefill_tokens=n))
        sent = [link for link in self._links.values() if link in work or (link.ops and link.due())]
        prefill_tokens = {link: sum(w.prefill_tokens for w in work.get(link, [])) for link in sent}
        start = time.monotonic()
        with self.profile.span("draft.encode"):
            for link in sent:  # every replica drafts at the same time
                link.stream.send(spec_pb.TargetStep(ops=link.take_ops(), work=work.get(link, [])))
        for link in sent:
            timing = link.replica.timing
            owed, link.owed_prefill = link.owed_prefill, 0  # catch-up sent earlier, maybe still running
            try:
                reply = self._read_owed(link, start + timing.deadline_s(prefill_tokens[link] + owed))
            except DraftStreamError as exc:
                if exc.code_name == "DEADLINE_EXCEEDED":  # slow or frozen: next time (after a health probe) it
                    timing.late(time.monotonic() - start)  # gets at least this long again, plus the slack
                self._fail_link(link, exc)
                continue
            if not owed:  # its own time, not the wait for work sent before
                timing.record(link.stream.last_arrival - start, prefill_tokens[link])
            if link.replica.failures:                                            # for replicas read before it
                self.replicas.mark_ok(link.replica)
            with self.profile.span("draft.decode"):
                self._collect_trees(reply, requests, out)
        out.update(self._errors)
        self._errors = {}
        return out

    def observe(self, steps: dict[str, tuple[VerifiedStep, SpecStats]]) -> None:
        steps = {key: step for key, step in steps.items() if key in self._home}  # a failed replica's sessions: the
        # scheduler drops their drafts with the next propose
        candidates = self._candidates(steps)
        for key, (verified, stats) in steps.items():
            self._stats[key] = stats
            if key in self._unstarted:  # not on its replica yet: its context grows here
                self._unstarted[key].prompt_ids.extend(verified.result.committed_tokens)
                continue
            link = self._home[key]
            teacher = teacher_signal(verified.target_logits, link.teacher_top_k) \
                if link.teacher_top_k and key in self._drafted else None
            op = session_op_to_proto(key, "outcome", result=verified.result, candidates=candidates.get(key, {}),
                                     teacher=teacher)
            if teacher is not None:
                stats.teacher_signal_bytes += op.outcome.teacher.ByteSize()  # what the frame carries for it
            link.queue(op, append_only=key not in self._drafted)

    def _candidates(self, steps: dict[str, tuple[VerifiedStep, SpecStats]]) -> dict[str, dict[int, float]]:
        """Misses and buffer candidates of the sessions that drafted with a restricted A, all at once; the time is
        shared evenly among them."""
        keys = [key for key in steps if self.mirrors[key].restricted and key in self._drafted]
        if not keys:
            return {}
        start = time.perf_counter()
        feedbacks = feedbacks_for([FeedbackRequest(steps[key][0], self.mirrors[key].mask, self._wants_candidates[key],
                                                   steps[key][1], self.mirrors[key].source_of) for key in keys])
        shared = (time.perf_counter() - start) / len(keys)
        for key in keys:
            self._feedback_seconds[key] += shared
        return {key: fb.candidates for key, fb in zip(keys, feedbacks)}

    def flush(self) -> None:
        """Send the step's outcomes and closes now (the replicas commit them while the target goes on); appends alone
        wait for a later message (`_Link`). Stream errors surface at the next exchange."""
        self._drafted = set()
        for link in self._links.values():
            if link.ops and link.due():
                link.stream.send(spec_pb.TargetStep(ops=link.take_ops()))

    def close(self, key: str) -> None:
        self.mirrors.pop(key, None)
        link = self._home.pop(key, None)
        if link is not None:
            link.sessions.discard(key)
            if self._unstarted.pop(key, None) is None:  # one never started has nothing to close on its replica
                link.queue(session_op_to_proto(key, "close"))
        for table in (self._wants_candidates, self._stats, self._feedback_seconds, self._errors):
            table.pop(key, None)

    def shutdown(self) -> None:
        for link in self._links.values():
            link.stream.close()
        self._links.clear()

    def _drop_idle_links(self, healthy: list[DraftReplica]) -> None:
        """Close streams that hold no session and lead to a replica that failed or was replaced (their reader
        threads end), so a replica that comes back gets a fresh stream."""
        current = {r.address: r for r in healthy}
        for address, link in list(self._links.items()):
            if not link.sessions and (link.stream.dead or current.get(address) is not link.replica):
                link.stream.close()
                del self._links[address]

    def _read_owed(self, link: _Link, deadline: float) -> spec_pb.DraftStep:
        """Every reply still owed by `link` (earlier flushes: their buffer changes and errors are applied in order);
        returns the last, the reply to this step."""
        while True:
            with self.profile.span("draft.wait"):
                reply = link.stream.receive(deadline)
            link.teacher_top_k = reply.teacher_top_k
            with self.profile.span("draft.decode"):
                self._apply(reply)
            last = link.stream.outstanding == 0
            if last:  # this step's work, on the critical path
                self.profile.add("draft.remote_compute", reply.compute_seconds)
                self.profile.add("draft.remote_codec", reply.codec_seconds)
            else:  # an earlier flush's outcomes, committed while the target verified
                self.profile.add("draft.remote_feedback", reply.compute_seconds + reply.codec_seconds)
            self.profile.add("draft.remote_predraft", reply.predraft_seconds)
            if last:
                return reply

    def _fail_link(self, link: _Link, error: DraftStreamError) -> None:
        """Drop the replica's stream; each of its sessions gets `error` (the scheduler runs them target-only)."""
        link.stream.close()
        self._links.pop(link.replica.address, None)
        if error.retryable:
            self.replicas.mark_failed(link.replica, str(error))
        for key in link.sessions:
            self._home.pop(key, None)
            self._unstarted.pop(key, None)
            self._errors[key] = error
        link.sessions.clear()

    def _collect_trees(self, reply: spec_pb.DraftStep, requests: dict[str, TreeParams],
                       out: dict[str, DraftTree | Exception]) -> None:
        for session in reply.sessions:
            key = session.session_id
            if session.has_tree and key in requests and key in self.mirrors:
                mirror = self.mirrors[key]
                try:
                    out[key] = checked_tree(tree_from_proto(
                        session.reply, mirror.row_ids.clone() if session.reply.draft_probs else None, self.device),
                        requests[key])
                except ValueError as exc:  # a malformed tree fails its session, never the batch
                    out[key] = DraftStreamError(f"draft: {exc}", "INTERNAL")
                    continue
                stats = self._stats.get(key)
                if session.predrafted and stats is not None:
                    stats.predrafted_steps += 1

    def _apply(self, reply: spec_pb.DraftStep) -> None:
        if self.static_vocab_sha and reply.static_vocab_sha and reply.static_vocab_sha != self.static_vocab_sha:
            raise vocab_mismatch(reply.static_vocab_sha, self.static_vocab_sha)
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
    """A tree from another process, checked before the target forwards it: shapes agree, parents precede children
    (or are the root, -1), draft distributions belong to its nodes and match its active set, and it is no larger
    than the shape asked for. (Batched verification indexes every tree's rows in one flat layout, so a tree that
    broke these would reach other requests' rows.)"""
    if tree.parents.shape != tree.token_ids.shape:
        raise ValueError(f"tree has {tree.size} tokens but {tree.parents.shape[0]} parents")
    if tree.draft_probs:
        stray = [k for k in tree.draft_probs if not -1 <= k < tree.size]
        if stray:
            raise ValueError(f"draft distributions for nodes {stray[:3]} of a {tree.size}-node tree")
        width = None if tree.active_ids is None else tree.active_ids.shape[-1]
        if any(q.shape[-1] != width for q in tree.draft_probs.values()):
            raise ValueError(f"draft distributions do not match the {width} active ids")
    if tree.size > params.max_nodes:
        raise ValueError(f"tree of {tree.size} nodes; at most {params.max_nodes} were asked for")
    if tree.depth > params.levels:
        raise ValueError(f"tree deeper than the {params.levels} levels asked for")
    return tree
