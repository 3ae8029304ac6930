"""Continuous batching: one scheduler owns every running generation of a target replica and steps them together.

One engine step:
1. Admit waiting requests (FCFS) while the KV arenas have a region for them and fewer than `max_running` run;
   drop cancelled and expired ones.
2. Choose the step's draft depth (budget.py; fixed at each request's own shape when `adaptive` is off).
3. Draft: one packed draft forward per tree level over every speculative session (plus the draft's share of prefill).
   Then prompt-lookup chains (engine/lookup.py), at a depth the budget chooses for them, for `lookup` requests and
   for those whose draft proposed no tree this step (`lookup_fallback`).
4. Target: one packed forward over prefill chunks (at most `prefill_chunk` prompt tokens in all) and every decoding
   session's [pending] + tree, the LM head on the verified rows only, `verify_batch`, commit.
5. Stop rules, events to each request's sink, feedback to the draft (buffer updates) for those that go on.

A draft that fails (an error, a broken stream, no reply within its deadline) never fails a generation: the request
drops its draft and continues target-only from its committed state (`SpecStats.fallback_steps/fallback_reason`).
After a backoff, and once the drafter says a draft is available again, it resumes speculation: a new draft session
over everything committed so far, prefilled in chunks, then drafting as before (`SpecStats.draft_resumes`). Each
request's `DraftLease` (lease.py) keeps that state and makes those decisions; the scheduler calls the drafter.

Each request keeps its own method, tree, vocabulary sizes, sampling parameters, seed and stop rules; the per-request
loop (`SpeculativeDecoder.generate`) is the reference its output is tested against (tests/unit/test_scheduler.py).
No Ray or gRPC here: fronts call `submit` from any thread and read events from the sink they pass. The thread that
runs the steps, and its health, are `SchedulerThread`'s (runner.py); tests and benchmarks step a scheduler themselves.
"""
from __future__ import annotations

import collections
import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from evospec.config import SamplingParams, SchedulerConfig, SpecParams, TreeParams, clip_depth, draft_seed, traits
from evospec.engine.budget import LOOKUP_KIND, Acceptance, SpeculationBudget, StepOutcome, draft_kind
from evospec.engine.drafter import BatchDrafter, DraftRequest, LocalBatchDrafter
from evospec.engine.generate import SpeculativeDecoder, apply_stop_rules
from evospec.engine.lease import DraftLease, plan_catch_up
from evospec.engine.lookup import NgramIndex, chain_tree
from evospec.engine.profile import StepProfile
from evospec.engine.stats import SpecStats
from evospec.engine.target import TargetSession
from evospec.errors import EvoSpecError, InvalidRequestError, OverloadedError
from evospec.model import KVArena
from evospec.tree import DraftTree

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokensOut:
    token_ids: list[int]


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # 'stop' | 'length'
    stats: SpecStats


@dataclass(frozen=True)
class Failed:
    error: BaseException  # EvoSpecError subclasses carry what the client should know; TimeoutError = deadline


SchedulerEvent = TokensOut | Finished | Failed
Sink = Callable[[SchedulerEvent], None]


class DeadlineExceeded(EvoSpecError, TimeoutError):
    """The request's deadline passed before it finished (-> DEADLINE_EXCEEDED)."""


@dataclass
class _Request:
    key: str
    prompt_ids: list[int]
    sampling: SamplingParams
    spec: SpecParams
    seed: int
    sink: Sink
    deadline: float | None  # time.monotonic()
    stats: SpecStats
    lease: DraftLease  # its draft session: held, lost, resumed (lease.py)
    cancelled: threading.Event = field(default_factory=threading.Event)
    target: TargetSession | None = None
    output_ids: list[int] = field(default_factory=list)
    acceptance: Acceptance = field(default_factory=Acceptance)
    catch_up_pays: bool | None = None  # the last catch-up decision (logged when it changes)
    lookup: NgramIndex | None = None  # its context's n-grams: the source of `lookup` chains (and of the fallback's)
    lookup_acceptance: Acceptance = field(default_factory=Acceptance)  # of its prompt-lookup chains

    @property
    def kind(self) -> tuple:
        return draft_kind(self.spec)

    @property
    def lookup_shape(self) -> TreeParams:
        """Its prompt-lookup chains at most: as deep as its tree (one continuation per step)."""
        return TreeParams(shape="chain", num_draft_tokens=self.spec.tree.levels)

    @property
    def max_len(self) -> int:
        return len(self.prompt_ids) + self.sampling.max_tokens + self.spec.tree.max_nodes + 2


class WaitingQueue:
    """Submitted requests not yet admitted, first come first served: filled from the fronts' threads, emptied by the
    scheduler's, at most `max_waiting` (OverloadedError beyond). Once closed, submissions get the closing error
    (shutting down, or the engine stopped)."""

    def __init__(self, max_waiting: int):
        self.max_waiting = max_waiting
        self._items: collections.deque[_Request] = collections.deque()
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)  # notified by every put, cancel and close
        self.closed: Callable[[], BaseException] | None = None  # the error a submission gets once closed

    def __len__(self) -> int:
        return len(self._items)

    def put(self, request: _Request) -> None:
        with self._lock:
            if self.closed is not None:
                raise self.closed()
            if len(self._items) >= self.max_waiting:
                raise OverloadedError(f"{len(self._items)} requests already wait for KV memory (max_waiting="
                                      f"{self.max_waiting}); retry later")
            self._items.append(request)
            self.changed.notify()

    def head(self) -> _Request | None:
        with self._lock:
            return self._items[0] if self._items else None

    def pop(self) -> None:
        with self._lock:
            self._items.popleft()

    def drain(self) -> list[_Request]:
        with self._lock:
            items = list(self._items)
            self._items.clear()
            return items

    def notify(self) -> None:
        with self._lock:
            self.changed.notify()

    def close(self, error: Callable[[], BaseException]) -> None:
        """From now on `put` raises `error()` (the first close's error stays)."""
        with self._lock:
            self.closed = self.closed or error
            self.changed.notify()


class RequestHandle:
    def __init__(self, request: _Request, wake: Callable[[], None]):
        self._request, self._wake = request, wake

    @property
    def key(self) -> str:
        return self._request.key

    @property
    def stats(self) -> SpecStats:
        return self._request.stats

    def cancel(self) -> None:
        """Stop the generation: its KV and draft session are freed at the scheduler's next step; events of the step
        in flight may still arrive, none after it."""
        self._request.cancelled.set()
        self._wake()


class Scheduler:
    def __init__(self, decoder: SpeculativeDecoder, config: SchedulerConfig = SchedulerConfig(),
                 drafter: BatchDrafter | None = None, budget: SpeculationBudget | None = None):
        """decoder: the target (and, for an in-process draft, the draft) with their vocabulary policies and stop
        ids; drafter: where trees come from (default: the decoder's draft model in this process, batched); budget:
        what chooses each step's draft depth (default: measured now when `config.adaptive`, else none)."""
        self.decoder, self.config = decoder, config
        self.arena = KVArena(decoder.target.model, config.kv_tokens)
        if drafter is None and decoder.draft is not None:
            draft_arena = KVArena(decoder.draft.model, config.draft_kv_tokens or config.kv_tokens)
            drafter = LocalBatchDrafter(decoder.draft, decoder.policies, draft_arena)
        self.drafter = drafter
        self.profile = StepProfile()  # where step time goes (evospec bench decoupled --breakdown)
        if hasattr(drafter, "profile"):
            drafter.profile = self.profile  # a remote drafter adds its transport's parts
        if budget is None and config.adaptive:
            budget = SpeculationBudget.measured(decoder.target.model,
                                                decoder.draft.model if decoder.draft is not None else None)
        self.budget = budget
        self.waiting = WaitingQueue(config.max_waiting)
        self._running: dict[str, _Request] = {}  # key -> request, in admission order
        self._draft_failed = False  # the draft failed a session in the current step
        self.steps = 0
        self.depth_histogram: collections.Counter[int] = collections.Counter()  # chosen draft depth per step

    # ---- fronts -------------------------------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], sampling: SamplingParams, spec: SpecParams, sink: Sink,
               deadline: float | None = None) -> RequestHandle:
        """Validate (InvalidRequestError names the field), queue (OverloadedError when it cannot be), return a handle.
        Events then arrive through `sink`, from the scheduler's thread: TokensOut..., then Finished or Failed."""
        self.decoder.validate(prompt_ids, sampling, spec, remote_draft=self.drafter is not None)
        if spec.speculative and self.drafter is None:
            self.decoder.validate(prompt_ids, sampling, spec)  # raises: no draft model
        seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(8), "little")
        stats = SpecStats(prompt_tokens=len(prompt_ids))
        lease = DraftLease(stats, self.config.draft_retry_s, self.config.draft_max_retry_s)
        request = _Request(uuid.uuid4().hex, list(prompt_ids), sampling, spec, seed, sink, deadline, stats, lease)
        self._check_fits(request)
        self.waiting.put(request)
        return RequestHandle(request, self.waiting.notify)

    def _check_fits(self, request: _Request) -> None:
        """Refuse at once what no amount of waiting would admit: more KV than an arena holds (a client mistake:
        InvalidRequestError naming max_tokens, not an overload a retry could fix)."""
        draft_arena = getattr(self.drafter, "arena", None)
        needs = [(request.max_len, self.arena.capacity, "kv_tokens")]
        if request.spec.speculative and draft_arena is not None:
            needs.append((self.drafter.kv_tokens(draft_request(request)), draft_arena.capacity,
                          "draft_kv_tokens"))
        for tokens, capacity, name in needs:
            if tokens > capacity:
                raise InvalidRequestError("max_tokens", f"the request needs {tokens} KV tokens (prompt "
                                      f"{len(request.prompt_ids)} + max_tokens {request.sampling.max_tokens} + one "
                                      f"tree); this replica holds {capacity} (scheduler.{name}): lower max_tokens or "
                                      f"the prompt")

    def num_running(self) -> int:
        return len(self._running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def num_without_draft(self) -> dict[str, int]:
        """Running speculative requests that decode target-only now, by why: `draft_unavailable` (their draft
        failed or could not be opened, and has not resumed yet) and `catch_up_deferred` (their draft lacks context
        and the budget has not bought its catch-up: `_catch_ups_that_pay`). Read from any thread (/metrics)."""
        counts = {"draft_unavailable": 0, "catch_up_deferred": 0}
        for request in list(self._running.values()):  # a C-level copy: safe against the scheduler thread
            if not request.spec.speculative or request.target is None or request.target.prefill_remaining:
                continue
            if not request.lease.held:
                counts["draft_unavailable"] += 1
            elif request.lease.lag and request.catch_up_pays is False:
                counts["catch_up_deferred"] += 1
        return counts

    def fail_everything(self, error: BaseException, waiting: bool = True) -> None:
        """Fail what runs, and what waits unless `waiting` is False (SchedulerThread: a step that raised fails the
        requests it hit; a thread that ends fails everything, its queue closed)."""
        for request in [*self._running.values(), *(self.waiting.drain() if waiting else ())]:
            self._fail(request, error)

    # ---- stepping -----------------------------------------------------------------------------------------------
    def run_until_idle(self) -> None:
        """Step until nothing runs or waits (tests and benchmarks drive the scheduler without its thread)."""
        while self._running or len(self.waiting):
            self.step()

    def step(self) -> None:
        profile = self.profile
        self._draft_failed = False
        with profile.span("admit"):
            self._admit()
            self._drop_cancelled()
            if self.drafter is not None:
                self._resume_drafts()
        if not self._running:
            if self.drafter is not None:
                self.flush_drafter()  # the closes of requests just dropped: an idle scheduler has no next step
            return
        with profile.span("plan"):
            prefills = plan_prefill(self._running.values(), self.config.prefill_chunk)
            decoding = [r for r in self._running.values() if r.target.prefill_remaining == 0]
            drafting = [r for r in decoding if r.lease.drafting]  # before _draft: a catch-up may end, a failure drop
            k = self._choose_depth(drafting, sum(prefills.values()))
        start = time.perf_counter()
        with profile.span("draft"):
            trees, draft_prefill = self._draft(decoding, prefills, k)
            looking_up = [r for r in decoding if r.lookup is not None and r.key not in trees and r.key in self._running]
            others = {r.key for r in decoding} - {r.key for r in looking_up}
            k_lookup = self._choose_lookup_depth(looking_up, sum(prefills.values()) + sum(
                1 + (trees[key].size if key in trees else 0) for key in others))
            chains = lookup_trees(looking_up, k_lookup)
        trees.update(chains)
        draft_seconds = time.perf_counter() - start
        tokens, target_seconds, feedback_seconds, committed = self._verify(decoding, prefills, trees,
                                                                           {r.key for r in drafting}, set(chains))
        with profile.span("plan"):
            if self.budget is not None:
                self.budget.record_step_outcome(StepOutcome(
                    depth=k, lookup_depth=k_lookup,
                    trees=[(LOOKUP_KIND, r.lookup_shape) if r.key in chains else (r.kind, r.spec.tree)
                           for r in decoding if r.key in trees],
                    drafting=[r.kind for r in decoding if r.lease.drafting] + [LOOKUP_KIND] * len(looking_up),
                    prefilled=bool(prefills),
                    draft_prefilled=draft_prefill, draft_failed=self._draft_failed, tokens=tokens,
                    target_seconds=target_seconds,
                    draft_seconds=draft_seconds + feedback_seconds, committed=committed))
        if self.drafter is not None:
            with profile.span("flush"):
                self.flush_drafter()
        self.steps += 1
        profile.count_step(k)
        self.depth_histogram[k] += 1

    # ---- one step, layer by layer -------------------------------------------------------------------------------
    def _admit(self) -> None:
        while (request := self.waiting.head()) is not None and len(self._running) < self.config.max_running:
            if request.deadline is not None and time.monotonic() > request.deadline:
                self.waiting.pop()
                self._fail(request, DeadlineExceeded("deadline exceeded while waiting for KV memory"))
                continue
            if request.cancelled.is_set():
                self.waiting.pop()
                continue
            cache = self.arena.reserve(request.max_len)
            if cache is None:
                if not self._running:  # nothing will free KV: an arena too fragmented or leaked; never spin
                    self.waiting.pop()
                    self._fail(request, OverloadedError("no KV region large enough is free; retry later"))
                    continue
                return  # FCFS: the head waits for KV, the others wait behind it
            if request.spec.speculative:
                try:
                    self.drafter.open(request.key, draft_request(request))
                except OverloadedError as exc:
                    self.arena.release(cache)
                    if not self._running:
                        self.waiting.pop()
                        self._fail(request, exc)
                        continue
                    return
                except Exception as exc:  # noqa: BLE001 - no draft: the request runs target-only (lossless)
                    request.lease.failed(exc)
                else:
                    deferred = self.config.draft_prefill == "deferred"
                    request.lease.opened(len(request.prompt_ids) - 1 if deferred else 0)
            if self._proposes_by_lookup(request.spec):
                request.lookup = NgramIndex(request.prompt_ids)
            request.target = self.decoder.target.open(request.prompt_ids, request.sampling, cache, request.seed)
            self.waiting.pop()
            self._running[request.key] = request

    def _proposes_by_lookup(self, spec: SpecParams) -> bool:
        """`lookup` requests, and with the fallback (`lookup_fallback`, under a budget) every draft-model request."""
        fallback = spec.speculative and self.config.lookup_fallback and self.budget is not None
        return traits(spec.method).lookup or fallback

    def _drop_cancelled(self) -> None:
        now = time.monotonic()
        for request in list(self._running.values()):
            if request.cancelled.is_set():
                self._release(request)
            elif request.deadline is not None and now > request.deadline:
                self._fail(request, DeadlineExceeded(f"deadline exceeded after {len(request.output_ids)} tokens"))

    def _resume_drafts(self) -> None:
        """Generations whose draft failed get a new draft session once their lease is due and the drafter has a
        draft available: over everything committed so far, prefilled in chunks (the lease's `lag`) before it
        drafts."""
        now = time.monotonic()
        due = [r for r in self._running.values()
               if r.spec.speculative and r.target.prefill_remaining == 0 and r.lease.due(now)]
        if not due or not self.drafter.available():
            return
        for request in due:
            context = request.prompt_ids + request.output_ids
            try:
                self.drafter.open(request.key, DraftRequest(context, request.sampling, request.spec, request.max_len,
                                                            draft_seed(request.seed)))
            except Exception as exc:  # noqa: BLE001 - still no draft: try again after a longer backoff
                request.lease.failed(exc)
                continue
            request.lease.resumed(len(context))
            log.info("request %s resumes speculation (%d context tokens to catch up)", request.key[:8],
                     request.lease.lag)

    def _choose_depth(self, speculative: list[_Request], prefill_tokens: int) -> int:
        if not speculative:
            return 0
        if self.budget is None:
            return max(r.spec.tree.levels for r in speculative)
        return self.budget.choose([(r.spec.tree, r.acceptance, r.kind) for r in speculative], prefill_tokens)

    def _choose_lookup_depth(self, requests: list[_Request], other_tokens: int) -> int:
        """The depth of this step's prompt-lookup chains (engine/lookup.py) for `requests`: `lookup` requests and,
        with the fallback, requests whose draft proposed no tree this step; `other_tokens`: the rest of the step's
        target forward (prefill chunks, the draft's trees, plain rows). Without a budget, each chain's full depth."""
        if not requests:
            return 0
        if self.budget is None:
            return max(r.lookup_shape.levels for r in requests)
        return self.budget.choose([(r.lookup_shape, r.lookup_acceptance, LOOKUP_KIND) for r in requests],
                                  other_tokens, source="lookup")

    def _draft(self, decoding: list[_Request], prefills: dict[str, int], k: int) -> tuple[dict[str, DraftTree], bool]:
        """This step's trees (depth k) and whether a draft session prefilled: with the target's prompt chunks
        (draft_prefill with_target), or catching up once the target's prefill is done (deferred, and resumed
        sessions)."""
        requests = {r.key: clip_depth(r.spec.tree, k) for r in decoding if r.lease.drafting and k > 0}
        draft_prefills = {key: n for key, n in prefills.items() if self._running[key].lease.drafting}
        # Catch-up waits for a step without target prefill (and for the request's first token): on shared hardware
        # it would otherwise delay other requests' first tokens. And it waits until it pays (`_catch_ups_that_pay`).
        catching_up = [(r.key, r.lease) for r in self._catch_ups_that_pay(decoding)] if not prefills else []
        catch_up = plan_catch_up(catching_up, self.config.prefill_chunk - sum(draft_prefills.values()))
        draft_prefills.update(catch_up)
        if not requests and not draft_prefills:
            return {}, False
        start = time.perf_counter()
        try:
            if requests:
                proposed = self.drafter.propose(requests, draft_prefills)
            else:  # catch-up alone: a remote draft prefills while the target runs this step
                proposed = self.drafter.prefill(draft_prefills)
        except Exception as exc:  # noqa: BLE001 - a draft failure drops the draft of its sessions, nothing more
            proposed = {key: exc for key in [*requests, *draft_prefills]}
        seconds = time.perf_counter() - start
        trees = {}
        for key, tree in proposed.items():
            if isinstance(tree, Exception):
                if key in self._running:
                    self._drop_draft(self._running[key], tree)
            elif key in requests:
                trees[key] = tree
                self._running[key].stats.draft_seconds += seconds
                self._running[key].lease.answered()
        for key, n in catch_up.items():
            request = self._running.get(key)
            if request is not None:
                request.lease.caught_up(n)
        if not requests and not self._draft_failed and self.budget is not None:  # a failure's wait is no rate
            self.budget.record_draft_prefill(sum(draft_prefills.values()), seconds)
        return trees, bool(draft_prefills)

    def _catch_ups_that_pay(self, decoding: list[_Request]) -> list[_Request]:
        """The decoding requests whose draft session lacks context (deferred prefill, resumed draft) and should
        prefill it now. Without a budget, all of them. With one, those whose expected saving over the tokens they
        are still expected to generate exceeds the catch-up's measured cost (`SpeculationBudget.catch_up`).
        A request whose catch-up never pays decodes as `ar` does, from its target session alone."""
        lagging = [r for r in decoding if r.output_ids and r.lease.held and r.lease.lag]
        if self.budget is None or not lagging:
            return lagging
        speculative = [(r.spec.tree, r.acceptance, r.kind) for r in decoding if r.lease.held]
        saved_per_token = functools.cache(functools.partial(self.budget.seconds_saved_per_token, speculative))
        paying = []
        for request in lagging:
            remaining = self.budget.expected_remaining(len(request.output_ids), request.sampling.max_tokens)
            decision = self.budget.catch_up(saved_per_token, request.kind, remaining, request.lease.lag)
            if decision.pays != request.catch_up_pays:
                log.info("request %s: the draft %s its %d-token catch-up (expected saving %.1f s over %d tokens, "
                         "cost %.1f s%s)", request.key[:8], "starts" if decision.pays else "defers",
                         request.lease.lag, decision.saved, remaining, decision.cost,
                         f"; {decision.why}" if decision.why else "")
                request.catch_up_pays = decision.pays
            if decision.pays:
                paying.append(request)
        return paying

    def _verify(self, decoding: list[_Request], prefills: dict[str, int], trees: dict[str, DraftTree],
                drafting: set[str], chains: set[str]) -> tuple[int, float, float, int]:
        """Target forward, verification, commit, events; then the draft's feedback. `chains`: the requests whose
        tree is a prompt-lookup chain. Returns the target forward's tokens and seconds, the feedback's seconds
        (draft-side work, like drafting itself) and the tokens the decoding sessions committed."""
        decoding = [r for r in decoding if r.key in self._running]  # a draft failure may have ended some
        prefill_items = [(r.target, n) for key, n in prefills.items() if (r := self._running.get(key))]
        verifies = [(r, trees.get(r.key, DraftTree.empty())) for r in decoding]
        start = time.perf_counter()
        try:
            steps = self.decoder.target.step(prefill_items, [(r.target, tree) for r, tree in verifies])
        except Exception as exc:  # noqa: BLE001 - an engine error fails this step's requests, never the thread
            for request in list(self._running.values()):
                self._fail(request, exc)
            return 0, 0.0, 0.0, 0
        seconds = time.perf_counter() - start
        self.profile.add("verify", seconds)
        commit_start = time.perf_counter()
        committed = sum(len(step.result.committed_tokens) for step in steps)
        forward_tokens = sum(n for _, n in prefill_items) + sum(1 + t.size for _, t in verifies)
        verify_seconds = seconds
        feedback = {}
        for (request, tree), verified in zip(verifies, steps):
            stats = request.stats
            stats.verify_seconds += seconds
            accepted = len(verified.result.accepted_nodes)
            stats.record_step(tree.size, accepted, tree.depth)
            if tree.size and self.budget is not None:
                if request.key in chains:
                    self.budget.record_tree(request.lookup_acceptance, LOOKUP_KIND, tree.depth, accepted)
                else:
                    self.budget.record_tree(request.acceptance, request.kind, tree.depth, accepted)
            if request.spec.speculative and stats.fallback_reason and not (request.key in drafting and
                                                                            request.lease.held):
                stats.fallback_steps += 1  # no tree: the draft failed, or its replacement was catching up
            tokens, finish = apply_stop_rules(verified.result.committed_tokens, len(request.output_ids),
                                              request.sampling, self.decoder.eos_ids)
            request.output_ids.extend(tokens)
            if request.lookup is not None and finish is None:
                request.lookup.extend(tokens)
            stats.generated_tokens = len(request.output_ids)
            if finish is None and request.lease.held:
                feedback[request.key] = (verified, stats)
            if tokens:
                deliver(request, TokensOut(tokens))
            if finish is not None:
                if self.budget is not None and finish == "stop":  # a natural end; max_tokens says nothing of it
                    self.budget.record_finished(len(request.output_ids))
                self._release(request)
                deliver(request, Finished(finish, stats))
        self.profile.add("commit", time.perf_counter() - commit_start)
        if feedback:
            start = time.perf_counter()
            try:
                self.drafter.observe(feedback)
            except Exception as exc:  # noqa: BLE001 - the draft is dropped; the generations go on target-only
                for key in feedback:
                    if key in self._running:
                        self._drop_draft(self._running[key], exc)
            seconds = time.perf_counter() - start
            self.profile.add("feedback", seconds)
            for key, (_, stats) in feedback.items():
                stats.draft_seconds += seconds
            return forward_tokens, verify_seconds, seconds, committed
        return forward_tokens, verify_seconds, 0.0, committed

    # ---- bookkeeping --------------------------------------------------------------------------------------------
    def _release(self, request: _Request) -> None:
        """Free the request's KV region and draft session (idempotent)."""
        self._running.pop(request.key, None)
        if request.target is not None:
            self.arena.release(request.target.cache)
        if request.lease.release():
            try:
                self.drafter.close(request.key)
            except Exception:  # noqa: BLE001 - closing is best effort; the draft side also times sessions out
                pass

    def flush_drafter(self) -> None:
        try:
            self.drafter.flush()
        except Exception as exc:  # noqa: BLE001 - the drafter's sessions go on target-only
            for request in [r for r in self._running.values() if r.lease.held]:
                self._drop_draft(request, exc)

    def _drop_draft(self, request: _Request, error: BaseException) -> None:
        """Lossless fallback (lease.py): the generation goes on from its exact committed state without the draft;
        its session is closed. Its statistics count those steps and say why."""
        self._draft_failed = True  # this step's draft costs are not drafting's (budget.record_step_outcome)
        if not request.lease.lose(error):
            return
        log.warning("request %s continues without its draft: %s", request.key[:8], request.stats.fallback_reason)
        try:
            self.drafter.close(request.key)
        except Exception:  # noqa: BLE001 - closing is best effort
            pass

    def _fail(self, request: _Request, error: BaseException) -> None:
        self._release(request)
        deliver(request, Failed(error))


def draft_request(request: _Request) -> DraftRequest:
    """What the drafter is asked to open for `request`: its prompt, sampling, speculation, KV bound and draft seed."""
    return DraftRequest(request.prompt_ids, request.sampling, request.spec, request.max_len, draft_seed(request.seed))


def lookup_trees(requests: list[_Request], k: int) -> dict[str, DraftTree]:
    """Prompt-lookup chains for a step of depth k (engine/lookup.py); none where the context has no match."""
    trees = {}
    for request in requests if k > 0 else ():
        proposal = request.lookup.propose(clip_depth(request.lookup_shape, k).levels)
        if proposal:
            trees[request.key] = chain_tree(proposal, request.sampling)
    return trees


def plan_prefill(running: Iterable[_Request], chunk: int) -> dict[str, int]:
    """Prompt tokens to prefill this step per request key: at most `chunk` in all, oldest first."""
    room, plan = chunk, {}
    for request in running:
        remaining = request.target.prefill_remaining
        if remaining and room:
            plan[request.key] = min(remaining, room)
            room -= plan[request.key]
    return plan


def deliver(request: _Request, event: SchedulerEvent) -> None:
    """An event to the request's sink. A sink that fails (its consumer is gone) cancels its request; it never stops
    the scheduler."""
    try:
        request.sink(event)
    except Exception:  # noqa: BLE001
        request.cancelled.set()
