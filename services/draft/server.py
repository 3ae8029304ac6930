"""Transport-free draft server: the draft engine, the vocabulary policies and the open sessions of one replica.

The gRPC servicer (services/draft/servicer.py) converts the internal stream's messages: a target replica's
multiplexed stream calls `run_step` once per engine step, which applies every session's ops and drafts all their
trees with one packed forward per tree level.
"""
from __future__ import annotations

import logging
import math
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from evospec.adapt import Learner, TeacherSignal, build_learner
from evospec.config import DRAFTING_METHODS, SamplingParams, SpecParams, clip_depth
from evospec.engine.budget import DraftCosts
from evospec.engine.draft import DraftEngine, DraftSession
from evospec.engine.drafter import DraftRequest
from evospec.errors import InvalidRequestError, OverloadedError
from evospec.loading import apply_cpu_settings, in_passing_thread, load_cooc, load_model, load_static_ids
from evospec.services.config import DraftServiceConfig
from evospec.tree import DraftTree
from evospec.verify import VerifyResult
from evospec.vocab.dynamic import SlotChange
from evospec.vocab.registry import VocabPolicies
from evospec.vocab.retrieval import TargetFeedback

log = logging.getLogger(__name__)


@dataclass
class SessionStep:
    """One session's share of a multiplexed step: buffer changes (applied before its tree), its tree if it drafted,
    its totals, or the error that ended it."""
    changes: list[SlotChange] = field(default_factory=list)
    tree: DraftTree | None = None
    head_seconds: float = 0.0
    buffer_update_seconds: float = 0.0
    error: Exception | None = None
    predrafted: bool = False  # the tree was pre-drafted while the target verified the last one


@dataclass(frozen=True)
class Op:
    """An op of a multiplexed step: open (with its request), feed back a verified step, or close."""
    session_id: str
    kind: str  # "start" | "outcome" | "close"
    request: DraftRequest | None = None
    result: VerifyResult | None = None
    candidates: dict[int, float] | None = None
    teacher: TeacherSignal | None = None


@dataclass
class _Session:
    draft: DraftSession
    kv_tokens: int  # its cache's slots, counted against the server's max_kv_tokens
    update_seconds: float = 0.0
    pending_changes: list[SlotChange] = field(default_factory=list)  # applied while pre-drafting; in the next reply
    failure: Exception | None = None  # a deferred buffer update that failed while pre-drafting: ends the session
    drafted: bool = False  # a tree went out since the last outcome (an outcome without one only appends tokens)


class DraftServer:
    def __init__(self, engine: DraftEngine, policies: VocabPolicies, static_vocab_sha: str = "",
                 model_name: str = "", max_kv_tokens: int = 131072, predraft_hypotheses: int = 0):
        """max_kv_tokens: KV slots all open sessions may hold together (each session's cache is its own).
        predraft_hypotheses: outcomes of each tree to pre-draft while the target verifies it (sessions that ask)."""
        self.engine = engine
        self.policies = policies
        self.static_vocab_sha = static_vocab_sha
        self.model_name = model_name
        self.max_kv_tokens = max_kv_tokens
        self.predraft_hypotheses = predraft_hypotheses
        self._kv_tokens = 0  # held by open sessions
        self._shut_down = False
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()  # sessions are opened and closed from the stream server's threads

    @classmethod
    def from_config(cls, cfg: DraftServiceConfig) -> "DraftServer":
        apply_cpu_settings(cfg.model)

        def load() -> "DraftServer":  # every start-up forward, in a thread that ends (loading.in_passing_thread)
            model, folder = load_model(cfg.model, "draft")
            static_ids, sha = load_static_ids(cfg.static_vocab)
            policies = VocabPolicies(model.head_weight, static_ids, load_cooc(cfg.cooc),
                                     max_cache_bytes=int(cfg.policy_cache_mb * 2**20), quantized_head=model.head)
            learner = build_learner(model, cfg.adapt)  # before the head rows are gathered: LoRA wraps the layers only
            server = cls(DraftEngine(model, learner), policies, sha, str(Path(folder)), cfg.max_kv_tokens,
                         cfg.predraft_hypotheses)
            server.warm_up()
            return server
        server = in_passing_thread(load, "draft-load")
        learner = server.learner
        if learner is not None:
            learner.start()
        return server

    @property
    def learner(self) -> Learner | None:
        return self.engine.learner

    @property
    def teacher_top_k(self) -> int:
        """What the target should send with each outcome (0 = this replica does not adapt)."""
        return self.learner.cfg.teacher_top_k if self.learner is not None else 0

    def shutdown(self) -> None:
        """Stop the adaptation worker (saving the checkpoint when one is configured) and free every session."""
        self._shut_down = True
        with self._lock:
            keys = list(self._sessions)
        for key in keys:
            self.close(key)
        if self.learner is not None:
            self.learner.close()
            if self.learner.cfg.checkpoint:
                self.learner.export(self.learner.cfg.checkpoint)

    def health(self) -> str | None:
        """None while this server takes sessions (see DraftStreamServer.health, the deployment's predicate)."""
        return "the draft server is shut down" if self._shut_down else None

    def warm_up(self) -> None:
        """Draft one small tree per method before serving: the first forwards of a fresh process (allocations,
        int8 kernels, lazy initialisation) are several times slower, and a target would take that for a dead
        replica and fall back."""
        for method in DRAFTING_METHODS:
            request = DraftRequest(prompt_ids=[0] * 16, sampling=SamplingParams(max_tokens=8), spec=SpecParams(
                method=method), max_len=64, seed=0)
            step = self.run_step([Op("warm-up", "start", request)], {"warm-up": (2, 8)})["warm-up"]
            self.predraft(["warm-up"])  # its forwards are cold too
            self.close("warm-up")
            if step.error is not None:
                raise RuntimeError(f"draft warm-up ({method}) failed: {step.error}") from step.error

    def measure_costs(self) -> DraftCosts:
        """This draft's forwards, timed now (about a second): what a target's budget starts from. Measured when
        asked, not at warm-up: a target asks once its own start-up forwards are done, whereas at warm-up both
        replicas load and measure at once and, sharing a CPU's cores, each measured the other too (10x slower)."""
        costs = DraftCosts.measure(self.engine.model)
        log.info("draft forwards: %s", costs)
        return costs

    def export_adapter(self) -> bytes:
        """The learner's weights as safetensors bytes (InvalidRequestError when this replica does not adapt)."""
        with tempfile.TemporaryDirectory() as tmp:
            return self._adapting().export(Path(tmp) / "adapter.safetensors").read_bytes()

    def load_adapter(self, data: bytes) -> int:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "adapter.safetensors"
            path.write_bytes(data)
            learner = self._adapting()
            try:
                return learner.load(path)
            except ValueError as exc:
                raise InvalidRequestError("adapter", str(exc)) from None

    def _adapting(self) -> Learner:
        if self.learner is None:
            raise InvalidRequestError("adapt.mode", "this draft deployment does not adapt (adapt.mode: off)")
        return self.learner

    def num_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    def run_step(self, ops: list[Op], work: dict[str, tuple[int, int]]) -> dict[str, SessionStep]:
        """One engine step of a target replica: ops in order, then trees (depth > 0) and prefill chunks for `work`
        ({session id: (depth, prefill tokens)}) in one packed forward per level. Session ids are the caller's
        (the servicer namespaces them per stream). A failing op ends only its session."""
        out: dict[str, SessionStep] = {}
        for op in ops:
            entry = out.setdefault(op.session_id, SessionStep())
            try:
                if op.kind == "start":
                    entry.changes += self._create(op.session_id, op.request).draft.vocab.initial_changes
                elif op.kind == "outcome":
                    entry.changes += self._advance(self._get(op.session_id), op.result, op.candidates or {},
                                                   op.teacher)
                else:
                    self.close(op.session_id)
            except Exception as exc:  # noqa: BLE001 - reported for this session only
                self.close(op.session_id)
                entry.error = exc
        live = {sid: (depth, prefill) for sid, (depth, prefill) in work.items()
                if out.get(sid, SessionStep()).error is None}
        sessions = {sid: self._get_or_error(sid, out) for sid in live}
        for sid, session in list(sessions.items()):
            try:
                if session is not None:
                    self._check_work(session.draft, *live[sid])
            except InvalidRequestError as exc:  # this session only: the step's forwards must not fail for all
                self.close(sid)
                out.setdefault(sid, SessionStep()).error = exc
                sessions[sid] = None
        drafting = []
        for sid, session in sessions.items():
            if session is None or live[sid][0] == 0:
                continue
            entry = out.setdefault(sid, SessionStep())
            try:
                tree = self.engine.take_predrafted(session.draft, clip_depth(session.draft.tree_params, live[sid][0]))
                if tree is None:  # nothing pre-drafted for this outcome: a deferred buffer update goes first
                    entry.changes += self._settle(session)
            except Exception as exc:  # noqa: BLE001 - this session only
                self.close(sid)
                entry.error, sessions[sid] = exc, None
                continue
            if tree is not None:
                entry.tree, entry.predrafted = tree, True
            else:
                drafting.append(sid)
        requests = [(sessions[sid].draft, clip_depth(sessions[sid].draft.tree_params, live[sid][0]))
                    for sid in drafting]
        prefills = [(s.draft, live[sid][1]) for sid, s in sessions.items() if s is not None and live[sid][1] > 0]
        if requests or prefills:
            try:
                trees = self.engine.propose_many(requests, prefills)
            except Exception as exc:  # noqa: BLE001 - the step's drafting failed for every session in it
                for sid in sessions:
                    out.setdefault(sid, SessionStep()).error = exc
                return out
            for sid, tree in zip(drafting, trees):
                out[sid].tree = tree
        for sid, entry in out.items():
            session = self._sessions.get(sid)
            if session is not None:
                session.drafted = session.drafted or entry.tree is not None
                entry.changes[:0], session.pending_changes = session.pending_changes, []  # applied before these
                entry.head_seconds, entry.buffer_update_seconds = session.draft.head_seconds, session.update_seconds
        return out

    def predraft(self, session_ids: list[str], stop: Callable[[], bool] = lambda: False) -> None:
        """While the target verifies the trees just sent: deferred buffer updates (their changes go with the
        sessions' next replies), then the next trees of each tree's likeliest outcomes (engine.predraft), until
        `stop` says a message is waiting. Optional work: a failure turns pre-drafting off for these sessions and
        leaves them as a normal step does (a buffer update that fails fails its session at its next step, as
        without pre-drafting)."""
        with self._lock:
            sessions = [s for sid in session_ids if (s := self._sessions.get(sid)) is not None and s.draft.predraft]
        for session in sessions:
            try:
                session.pending_changes += self._settle(session)
            except Exception as exc:  # noqa: BLE001 - reported with the session's next reply
                session.failure = exc
        try:
            self.engine.predraft([s.draft for s in sessions if s.failure is None], stop)
        except Exception:  # noqa: BLE001 - optional work: never a stream's failure
            log.warning("pre-drafting failed; it is off for these %d sessions", len(sessions), exc_info=True)
            for session in sessions:
                session.draft.predraft = None

    def _settle(self, session: _Session) -> list[SlotChange]:
        start = time.perf_counter()
        changes = self.engine.settle(session.draft)
        session.update_seconds += time.perf_counter() - start
        return changes

    def _create(self, session_id: str, request: DraftRequest) -> _Session:
        if not request.spec.speculative:
            raise InvalidRequestError("start.spec.method", f"'{request.spec.method}' drafts nothing; it never opens a "
                                                           f"draft session")
        self._check_sizes(request)
        wants = request.spec.predraft and request.sampling.greedy  # pre-drafting is greedy-only
        hypotheses = self.predraft_hypotheses if wants else 0
        tokens = DraftEngine.cache_tokens(request.max_len, request.spec.tree, hypotheses)
        with self._lock:
            if session_id in self._sessions:
                raise InvalidRequestError("start.session_id", f"{session_id!r} is already open")
            if self._kv_tokens + tokens > self.max_kv_tokens:
                raise OverloadedError(f"draft KV memory is full ({self._kv_tokens} of {self.max_kv_tokens} tokens "
                                      f"held; this session needs {tokens}): retry later")
            self._kv_tokens += tokens
        try:
            draft = self.engine.start(request.prompt_ids, request.sampling, request.spec.tree,
                                      self.policies.get(request.spec), request.max_len, request.seed,
                                      hypotheses=hypotheses)
        except BaseException:
            with self._lock:
                self._kv_tokens -= tokens
            raise
        session = _Session(draft, tokens)
        with self._lock:
            duplicate = session_id in self._sessions
            if not duplicate:
                self._sessions[session_id] = session
            else:
                self._kv_tokens -= tokens
        if duplicate:  # opened by another thread meanwhile
            self.engine.end(draft)
            raise InvalidRequestError("start.session_id", f"{session_id!r} is already open")
        return session

    def _check_sizes(self, request: DraftRequest) -> None:
        """Caps on what a caller's sizes make this replica allocate: the session's KV cache is bounded by the model's
        context, and every prompt id must be a row of the embedding."""
        cfg = self.engine.model.cfg
        prompt = request.prompt_ids
        most = cfg.max_position_embeddings + request.spec.tree.max_nodes + 2  # a full context plus one tree
        if not len(prompt) < request.max_len <= most:
            raise InvalidRequestError("start.max_len", f"is {request.max_len}; it must exceed the prompt "
                                                       f"({len(prompt)} tokens) and be at most the draft's context "
                                                       f"plus one tree ({most})")
        if max(prompt) >= cfg.vocab_size:
            raise InvalidRequestError("start.prompt_token_ids", f"ids must be below the vocabulary size "
                                                                f"{cfg.vocab_size}")

    @staticmethod
    def _check_work(draft: DraftSession, depth: int, prefill: int) -> None:
        """Work the caller asks for must fit what the session holds: prefill only uncached prompt tokens, and a tree
        only while the session's cache has room for it (both would otherwise fail the step's packed forward)."""
        uncached = len(draft.tokens) - 1 - draft.cache.length
        if prefill and not prefill <= uncached:
            raise InvalidRequestError("work.prefill_tokens", f"is {prefill}; the session has {uncached} uncached "
                                                             f"prompt tokens")
        params = clip_depth(draft.tree_params, depth) if depth else None
        if params is not None and \
                DraftEngine.cache_tokens(len(draft.tokens), params) - 1 + params.max_nodes > draft.cache.max_len:
            raise InvalidRequestError("work.depth", f"no room for a tree: the session holds {len(draft.tokens)} of "
                                                    f"its {draft.cache.max_len} cache slots")

    def _advance(self, session: _Session, result: VerifyResult, candidates: dict[int, float],
                 teacher: TeacherSignal | None = None) -> list[SlotChange]:
        if session.failure is not None:  # its deferred buffer update failed while pre-drafting
            raise session.failure
        start = time.perf_counter()
        self._check_outcome(session.draft, result, candidates)
        teacher = self._usable_teacher(teacher)
        if not session.drafted:
            # A step the target ran without this session's tree (the budget chose depth 0, or the draft was catching
            # up): append its tokens, at a plain step's cost, as the in-process drafter does; the buffer does not see
            # that step, so a request that is not drafted for costs the draft (and a shared CPU) almost nothing.
            self.engine.commit(session.draft, result)
            return []
        session.drafted = False
        changes = self.engine.advance(session.draft, result, TargetFeedback(0, 0, candidates), teacher)
        session.update_seconds += time.perf_counter() - start
        return changes

    def _check_outcome(self, draft: DraftSession, result: VerifyResult, candidates: dict[int, float]) -> None:
        """A verified step must commit vocabulary ids that fit the session's cache; buffer candidates must be
        vocabulary ids with finite scores (the buffer indexes per-id tables with them)."""
        vocab, committed = self.engine.model.cfg.vocab_size, result.committed_tokens
        if max(committed) >= vocab:
            raise InvalidRequestError("outcome.accepted_tokens", f"ids must be below the vocabulary size {vocab}")
        bad = [t for t, score in candidates.items() if not (0 <= t < vocab and math.isfinite(score))]
        if bad:
            raise InvalidRequestError("outcome.buffer_candidates", f"ids must be below the vocabulary size {vocab} "
                                                                   f"with finite scores; got id {bad[0]}")
        if len(draft.tokens) + len(committed) >= draft.cache.max_len:
            raise InvalidRequestError("outcome", f"commits past the session's cache ({len(draft.tokens)} + "
                                                 f"{len(committed)} tokens of {draft.cache.max_len})")

    def _usable_teacher(self, teacher: TeacherSignal | None) -> TeacherSignal | None:
        """The teacher signal checked against what this replica asked for (None when it does not adapt)."""
        if teacher is None:
            return None
        vocab = self.engine.model.cfg.vocab_size
        if teacher.token_ids.numel() and not 0 <= int(teacher.token_ids.min()) <= int(teacher.token_ids.max()) < vocab:
            raise InvalidRequestError("outcome.teacher.token_ids", f"ids must be in [0, {vocab})")
        if self.learner is None:
            return None  # this replica does not adapt (its config changed since the target asked)
        if teacher.token_ids.shape[1] != self.teacher_top_k:
            raise InvalidRequestError("outcome.teacher.k", f"is {teacher.token_ids.shape[1]}; this replica asked "
                                                           f"for {self.teacher_top_k}")
        return teacher

    def _get_or_error(self, session_id: str, out: dict[str, SessionStep]) -> _Session | None:
        try:
            return self._get(session_id)
        except InvalidRequestError as exc:
            out.setdefault(session_id, SessionStep()).error = exc
            return None

    def close(self, session_id: str) -> None:
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is not None:
                self._kv_tokens -= session.kv_tokens
        if session is not None:
            self.engine.end(session.draft)

    def _get(self, session_id: str) -> _Session:
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise InvalidRequestError("session_id", f"{session_id!r} is not open")
        return session
