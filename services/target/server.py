"""Transport-free target server: admission, generation as an async iterator of typed events, metrics and info.

Fronts convert their wire types to `GenerateRequest` and the events back: the gRPC front
(services/target/grpc_api.py) and the OpenAI-compatible HTTP front (services/target/openai_api.py). Every generation
of the replica runs in one continuous-batching `Scheduler` (evospec/engine/scheduler.py), whose drafts come from the
draft replicas over one multiplexed stream each (RemoteMuxDrafter). Raises InvalidRequestError (the field to fix) and
OverloadedError; nothing here imports gRPC or Ray.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Protocol

import torch

from evospec.config import METHODS, SamplingParams, SpecParams
from evospec.engine.budget import DraftCosts
from evospec.engine.generate import SpeculativeDecoder
from evospec.engine.runner import SchedulerThread
from evospec.engine.scheduler import Failed, Finished, Scheduler, TokensOut
from evospec.engine.stats import SpecStats
from evospec.errors import InvalidRequestError
from evospec.kernels.linear import linear_orders
from evospec.loading import (
    apply_cpu_settings, cpu_description, in_passing_thread, load_model, load_static_ids, stop_token_ids,
)
from evospec.model import Qwen3
from evospec.model.qwen3 import forward_seconds
from evospec.services.common.bearer import check_bearer
from evospec.services.config import PublicApiConfig, TargetServiceConfig
from evospec.services.target.draft_link import DraftReplicas
from evospec.services.target.remote_draft import RemoteMuxDrafter
from evospec.services.target.textstream import TextStream, checked_stop
from evospec.tokenizer import chat_prompt_ids, load_tokenizer, max_token_bytes

log = logging.getLogger(__name__)

CHAT_ROLES = ("system", "user", "assistant")
CHAT_TEMPLATE_BYTES_PER_MESSAGE = 16  # "<|im_start|>" + "\n" + "<|im_end|>\n" around each message (Qwen template)


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class Prompt:
    """Exactly one of: raw text (tokenized as is), token ids, or chat messages (the model's chat template)."""
    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    enable_thinking: bool = False  # Qwen3 template switch


@dataclass(frozen=True)
class GenerateRequest:
    prompt: Prompt
    sampling: SamplingParams
    spec: SpecParams
    request_id: str = ""  # generated when empty
    stop: tuple[str, ...] = ()  # stop strings (services/target/textstream.py)


@dataclass(frozen=True)
class TokensEvent:
    """Tokens committed by one step (after stop rules) and the text that became final with them: a character whose
    bytes are not all in yet (or text that may begin a stop string) comes with a later event, so the last event
    may carry text and no tokens."""
    request_id: str
    token_ids: list[int]
    text: str


@dataclass(frozen=True)
class FinishedEvent:
    """The last event: finish reason ('stop' | 'length') and the statistics (evospec.v1.SpecStats fields)."""
    request_id: str
    finish_reason: str
    stats: dict


Event = TokensEvent | FinishedEvent


@dataclass(frozen=True)
class ServerInfo:
    version: str
    draft_model: str
    target_model: str
    methods: list[str]
    default_method: str
    max_model_len: int
    static_vocab_size: int
    static_vocab_sha: str
    device: str
    max_prompt_bytes: int  # prompt text over this many bytes is refused before tokenization
    target_dtype: str  # what the target computes in (dtype auto chooses per machine: evospec/loading.py)
    cpu: str  # this replica's CPU model and ISA
    target_weights: str  # the target's weight format (model.quantize auto measures per machine)


def api_tokens(public: PublicApiConfig) -> tuple[str, ...]:
    """The accepted bearer tokens: the config's and those in the environment variable it names (comma-separated)."""
    from_env = [t.strip() for t in os.environ.get(public.auth_tokens_env, "").split(",")]
    return tuple(dict.fromkeys(t for t in [*public.auth_tokens, *from_env] if t.strip()))  # never an empty token


def remote_draft_scheduler(model: Qwen3, eos_ids: tuple[int, ...], static_ids: torch.Tensor, static_vocab_sha: str,
                           cfg: TargetServiceConfig, pool: DraftReplicas) -> Scheduler:
    """The target replica's engine: a scheduler over `model` whose drafts come from the replicas of `pool` (not
    started: the service starts its thread; `evospec bench decoupled --transport local` steps it itself)."""
    decoder = SpeculativeDecoder(model, None, static_ids=static_ids, max_model_len=cfg.max_model_len, eos_ids=eos_ids)
    drafter = RemoteMuxDrafter(pool, decoder.policies.layout, decoder.target.vocab_size, static_vocab_sha,
                               decoder.target.device)
    if not cfg.scheduler.adaptive:  # first calls of each kernel at start-up, not in a user's first request (the
        forward_seconds(model, sizes=(1, 4, 64), repeats=0)  # adaptive budget's start-up measurement does this)
    return Scheduler(decoder, cfg.scheduler, drafter)


@dataclass(frozen=True)
class TargetReplica:
    """What a target replica serves with, as its server, fronts and metrics see it (they never reach into the
    engine): the scheduler that runs every generation and the thread that runs it, the context length, the loaded
    static vocabulary, and where and in which dtype the target computes."""
    scheduler: Scheduler
    runner: SchedulerThread
    max_model_len: int
    static_vocab_size: int
    static_vocab_sha: str
    device: str
    dtype: str  # "bfloat16" | "float32" | ...: dtype auto chooses per machine (evospec/loading.py)
    weights: str  # "int4-weight-only" | "none" | ...: model.quantize auto measures per machine

    @classmethod
    def serving(cls, scheduler: Scheduler, static_vocab_sha: str) -> "TargetReplica":
        """The replica of `scheduler`, its thread started."""
        decoder = scheduler.decoder
        static_ids = decoder.policies.static_ids
        return cls(scheduler, SchedulerThread(scheduler).start(), decoder.max_model_len,
                   0 if static_ids is None else int(static_ids.shape[0]), static_vocab_sha,
                   str(decoder.target.device),
                   str(decoder.target.model.embed_tokens.weight.dtype).removeprefix("torch."),
                   decoder.target.model.weight_format)


class MetricsSink(Protocol):
    def record(self, stats: SpecStats, method: str, ttft_s: float, e2e_s: float, finish_reason: str,
               dynamic_size: int = 0, inter_token_s: list[float] = ()) -> None: ...


@dataclass
class DraftSide:
    """The draft as the target sees it: its replicas for the data plane, and control-plane queries (Serve handles)."""
    pool: DraftReplicas
    model_name: Callable[[], Awaitable[str]]
    num_sessions: Callable[[], Awaitable[int]]
    adapt_stats: Callable[[], Awaitable[dict]] | None = None  # a draft replica's AdaptStats ({} = not adapting)


@dataclass
class TargetServer:
    replica: TargetReplica
    tokenizer: object
    drafts: DraftSide
    default_spec: SpecParams = SpecParams()
    model_name: str = ""
    metrics: tuple[MetricsSink, ...] = ()  # each records every finished generation (Ray's export, /metrics)
    api_tokens: tuple[str, ...] = ()  # bearer tokens of the public API (none = no authentication)
    max_prompt_bytes: int | None = None  # text over this cannot fit the context: refused before tokenization
    stream_interval: int = 1  # tokens per streamed message after the first (PublicApiConfig.stream_interval)
    active: dict[str, float] = field(default_factory=dict)  # request key -> start time

    @classmethod
    def from_config(cls, cfg: TargetServiceConfig, drafts: DraftSide, metrics: tuple[MetricsSink, ...] = ()
                    ) -> "TargetServer":
        apply_cpu_settings(cfg.model)
        static_ids, sha = load_static_ids(cfg.static_vocab)

        def load() -> tuple[Scheduler, Path]:  # every start-up forward, in a thread that ends (in_passing_thread)
            model, folder = load_model(cfg.model, "target")
            return remote_draft_scheduler(model, stop_token_ids(folder), static_ids, sha, cfg, drafts.pool), folder
        scheduler, folder = in_passing_thread(load, "target-load")
        replica = TargetReplica.serving(scheduler, sha)
        log.info("target linear maps, operand order measured on this machine: %s", linear_orders())
        tokenizer = load_tokenizer(str(folder))
        max_prompt_bytes = cfg.public.max_prompt_bytes or replica.max_model_len * max_token_bytes(tokenizer)
        return cls(replica, tokenizer, drafts, cfg.default_spec, str(Path(folder)), metrics, api_tokens(cfg.public),
                   max_prompt_bytes, cfg.public.stream_interval)

    @property
    def scheduler(self) -> Scheduler:
        return self.replica.scheduler

    def calibrate_draft(self, costs: DraftCosts) -> None:
        """Start the speculation budget from the draft's measured forwards (nothing without a budget). Called at the
        deployment's start-up, before it takes requests."""
        budget = self.scheduler.budget
        if budget is not None:
            budget.calibrate_draft(costs)
            log.info("budget starts from the draft's forwards: %s", costs)

    def authorize(self, authorization: str | None) -> None:
        """UnauthenticatedError unless the API is open or `authorization` is 'Bearer <one of the tokens>'."""
        if self.api_tokens:
            check_bearer(authorization, self.api_tokens)

    def close(self) -> None:
        """Stop the scheduler (what still runs fails with 'shutting down') and its draft stream."""
        self.replica.runner.stop()
        shutdown = getattr(self.scheduler.drafter, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def health(self) -> str | None:
        """The Target deployment's one health predicate (None = it serves): its scheduler thread alive and stepping.
        Serve's check_health, the gRPC health service and GET /health read it (services/common/health.py). The draft
        is not part of it: without one, generations run target-only."""
        return self.replica.runner.health()

    def num_sessions(self) -> int:
        return len(self.active)

    async def info(self) -> ServerInfo:
        replica = self.replica
        return ServerInfo(version=version("evospec-serve"), draft_model=await self.drafts.model_name(),
                          target_model=self.model_name, methods=list(METHODS),
                          default_method=self.default_spec.method, max_model_len=replica.max_model_len,
                          static_vocab_size=replica.static_vocab_size, static_vocab_sha=replica.static_vocab_sha,
                          device=replica.device, max_prompt_bytes=self.max_prompt_bytes or 0,
                          target_dtype=replica.dtype, cpu=cpu_description(), target_weights=replica.weights)

    def check_prompt_size(self, prompt: Prompt) -> None:
        """Refuse, without tokenizing, text that cannot fit the context (a prompt of many megabytes would hold a
        tokenizer thread for seconds), and token-id lists longer than the context."""
        limit, context = self.max_prompt_bytes, self.replica.max_model_len
        if prompt.token_ids is not None and len(prompt.token_ids) >= context:
            raise InvalidRequestError("prompt_token_ids", f"has {len(prompt.token_ids)} ids; the context holds "
                                                          f"{context} tokens")
        if limit is None:
            return
        messages = prompt.messages or ()
        if len(messages) >= context:  # each message renders to several template tokens
            raise InvalidRequestError("chat.messages", f"has {len(messages)} messages; the context holds {context} "
                                                       f"tokens")
        # Chat: the roles and the template's text around each message count too (an upper bound of its bytes).
        texts = [prompt.text] if prompt.text is not None else [m.role + m.content for m in messages]
        overhead = CHAT_TEMPLATE_BYTES_PER_MESSAGE * len(messages)
        field_name = "prompt" if prompt.text is not None else "chat.messages.content"
        chars = sum(len(t) for t in texts) + overhead  # a lower bound on the bytes: no encoding of a huge text
        size = chars if chars > limit else sum(len(t.encode("utf-8")) for t in texts) + overhead
        if size > limit:
            raise InvalidRequestError(field_name, f"is {size} bytes; at most {limit} fit the {context}-token "
                                                  f"context: shorten it")

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """Token ids of the prompt; InvalidRequestError names the field to fix."""
        given = [x is not None for x in (prompt.text, prompt.token_ids, prompt.messages)]
        if sum(given) != 1:
            raise InvalidRequestError("input", "set exactly one of prompt, prompt_token_ids or chat")
        self.check_prompt_size(prompt)
        if prompt.text is not None:
            if not prompt.text:
                raise InvalidRequestError("prompt", "is empty")
            return self.tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
        if prompt.token_ids is not None:
            return list(prompt.token_ids)
        if not prompt.messages:
            raise InvalidRequestError("chat.messages", "is empty")
        for i, message in enumerate(prompt.messages):
            if message.role not in CHAT_ROLES:
                raise InvalidRequestError(f"chat.messages[{i}].role",
                                          f"must be one of {', '.join(CHAT_ROLES)}; got {message.role!r:.50}")
        messages = [{"role": m.role, "content": m.content} for m in prompt.messages]
        return chat_prompt_ids(self.tokenizer, messages, prompt.enable_thinking)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """Validate and queue (raising before the first event: InvalidRequestError, OverloadedError when the
        scheduler's waiting queue is full), then stream TokensEvents and one FinishedEvent. Closing the iterator
        early (client gone) cancels the generation; the scheduler frees it at its next step. A stop string ends the
        generation at the token that completes it (finish 'stop'; the statistics are those of the steps run)."""
        start = time.perf_counter()
        request_id = request.request_id or uuid.uuid4().hex
        key = uuid.uuid4().hex  # two requests may carry the same client-chosen id
        self.active[key] = start
        handle = None
        try:
            text = TextStream(self.tokenizer, checked_stop(request.stop))
            # Tokenizing (and the chat template) runs on a worker thread: never on the loop that streams the others.
            prompt_ids = await asyncio.to_thread(self.prompt_ids, request.prompt)
            loop = asyncio.get_running_loop()
            events: asyncio.Queue = asyncio.Queue()  # bounded by max_tokens: every event but the last has tokens
            handle = self.scheduler.submit(prompt_ids, request.sampling, request.spec,
                                           lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
            clock = _TokenClock(start)
            pending: list[int] = []  # tokens held back by stream_interval
            pending_text = ""
            sent_tokens = 0
            while True:
                event = await events.get()
                while isinstance(event, TokensOut) and not events.empty():  # sent together: one message
                    pending += event.token_ids
                    event = events.get_nowait()
                if isinstance(event, TokensOut):
                    pending += event.token_ids
                    if clock.first is not None and len(pending) < self.stream_interval:
                        continue
                delta = text.feed(pending)
                pending_text += delta.text
                if delta.token_ids:  # the first and the last tokens never wait
                    clock.tick()
                    sent_tokens += len(delta.token_ids)
                    yield TokensEvent(request_id, delta.token_ids, pending_text)
                    pending, pending_text = [], ""
                if isinstance(event, TokensOut) and not text.stopped:
                    continue
                if isinstance(event, Failed) and not text.stopped:  # a stop string completed the answer first
                    handle = None  # failed: nothing left to cancel
                    raise event.error
                if text.stopped:  # a stop string ended it; a generation still running is freed at the next step
                    if not isinstance(event, Finished):
                        handle.cancel()
                    # A snapshot of the steps run (the scheduler may still be finishing the step in flight); the
                    # tokens are those sent, as in the usage: not the rest of the stop string's step.
                    stats = copy.deepcopy(event.stats if isinstance(event, Finished) else handle.stats)
                    finish_reason, stats.generated_tokens = "stop", sent_tokens
                else:
                    finish_reason, stats = event.finish_reason, event.stats
                handle = None
                rest = text.finish()
                if rest:
                    yield TokensEvent(request_id, [], rest)
                yield self._finished(request, request_id, finish_reason, stats, clock)
                return
        finally:
            if handle is not None:
                handle.cancel()
            self.active.pop(key, None)

    def _finished(self, request: GenerateRequest, request_id: str, finish_reason: str, stats: SpecStats,
                  clock: "_TokenClock") -> FinishedEvent:
        """Record the metrics of a finished generation and build its last event."""
        e2e = time.perf_counter() - clock.start
        ttft = clock.first if clock.first is not None else e2e
        for sink in self.metrics:
            sink.record(stats, request.spec.method, ttft, e2e, finish_reason, request.spec.vocab.dynamic_size,
                        inter_token_s=clock.gaps)
        return FinishedEvent(request_id, finish_reason, {**stats.as_dict(), "ttft_seconds": ttft, "e2e_seconds": e2e,
                                                         "method": request.spec.method})


@dataclass
class _TokenClock:
    """When a generation's token messages went out: TTFT and the gaps between messages (vLLM's inter-token
    latency, one observation per message after the first)."""
    start: float
    first: float | None = None  # seconds from start to the first tokens
    last: float = 0.0
    gaps: list[float] = field(default_factory=list)

    def tick(self) -> None:
        now = time.perf_counter() - self.start
        if self.first is None:
            self.first = now
        else:
            self.gaps.append(now - self.last)
        self.last = now
