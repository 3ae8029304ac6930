"""Transport-free target server: admission, generation as an async iterator of typed events, metrics and info.

Fronts convert their wire types to `GenerateRequest` and the events back: the gRPC front today
(services/target/grpc_api.py), an HTTP front next. Every generation of the replica runs in one continuous-batching
`Scheduler` (evospec/engine/scheduler.py), whose drafts come from the draft replica over one multiplexed stream
(RemoteMuxDrafter). Raises
InvalidRequestError (the field to fix) and OverloadedError; nothing here imports gRPC or Ray.
"""
from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Protocol

from evospec.config import METHODS, SamplingParams, SpecParams
from evospec.engine.generate import SpeculativeDecoder
from evospec.engine.scheduler import Failed, Finished, Scheduler, TokensOut
from evospec.engine.stats import SpecStats
from evospec.errors import InvalidRequestError
from evospec.loading import apply_cpu_settings, load_model, load_static_ids, stop_token_ids
from evospec.services.common.bearer import check_bearer
from evospec.services.config import PublicApiConfig, TargetServiceConfig
from evospec.services.target.draft_link import DraftReplicas
from evospec.services.target.remote_draft import RemoteMuxDrafter
from evospec.tokenizer import chat_prompt_ids, load_tokenizer, max_token_bytes

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


@dataclass(frozen=True)
class TokensEvent:
    """Tokens committed by one step (after stop rules) and their text."""
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


def api_tokens(public: PublicApiConfig) -> tuple[str, ...]:
    """The accepted bearer tokens: the config's and those in the environment variable it names (comma-separated)."""
    from_env = [t.strip() for t in os.environ.get(public.auth_tokens_env, "").split(",")]
    return tuple(dict.fromkeys(t for t in [*public.auth_tokens, *from_env] if t.strip()))  # never an empty token


class MetricsSink(Protocol):
    def record(self, stats: SpecStats, method: str, ttft_s: float, e2e_s: float, finish_reason: str,
               dynamic_size: int = 0) -> None: ...


@dataclass
class DraftSide:
    """The draft as the target sees it: its replicas for the data plane, and control-plane queries (Serve handles)."""
    pool: DraftReplicas
    model_name: Callable[[], Awaitable[str]]
    num_sessions: Callable[[], Awaitable[int]]


@dataclass
class TargetServer:
    decoder: SpeculativeDecoder
    tokenizer: object
    drafts: DraftSide
    scheduler: Scheduler
    default_spec: SpecParams = SpecParams()
    static_vocab_sha: str = ""
    model_name: str = ""
    metrics: MetricsSink | None = None
    api_tokens: tuple[str, ...] = ()  # bearer tokens of the public API (none = no authentication)
    max_prompt_bytes: int | None = None  # text over this cannot fit the context: refused before tokenization
    stream_interval: int = 1  # tokens per streamed message after the first (PublicApiConfig.stream_interval)
    active: dict[str, float] = field(default_factory=dict)  # request key -> start time

    @classmethod
    def from_config(cls, cfg: TargetServiceConfig, drafts: DraftSide, metrics: MetricsSink | None = None
                    ) -> "TargetServer":
        apply_cpu_settings(cfg.model)
        model, folder = load_model(cfg.model, "target")
        static_ids, sha = load_static_ids(cfg.static_vocab)
        decoder = SpeculativeDecoder(model, None, static_ids=static_ids, max_model_len=cfg.max_model_len,
                                     eos_ids=stop_token_ids(folder))
        drafter = RemoteMuxDrafter(drafts.pool, decoder.policies.layout, decoder.target.vocab_size, sha,
                                   decoder.target.device)
        scheduler = Scheduler(decoder, cfg.scheduler, drafter).start()
        tokenizer = load_tokenizer(str(folder))
        max_prompt_bytes = cfg.public.max_prompt_bytes or decoder.max_model_len * max_token_bytes(tokenizer)
        return cls(decoder, tokenizer, drafts, scheduler, cfg.default_spec, sha, str(Path(folder)), metrics,
                   api_tokens(cfg.public), max_prompt_bytes, cfg.public.stream_interval)

    def authorize(self, authorization: str | None) -> None:
        """UnauthenticatedError unless the API is open or `authorization` is 'Bearer <one of the tokens>'."""
        if self.api_tokens:
            check_bearer(authorization, self.api_tokens)

    def close(self) -> None:
        """Stop the scheduler (what still runs fails with 'shutting down') and its draft stream."""
        self.scheduler.stop()
        shutdown = getattr(self.scheduler.drafter, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def num_sessions(self) -> int:
        return len(self.active)

    async def info(self) -> ServerInfo:
        static_ids = self.decoder.policies.static_ids
        return ServerInfo(version=version("evospec-serve"), draft_model=await self.drafts.model_name(),
                          target_model=self.model_name, methods=list(METHODS),
                          default_method=self.default_spec.method, max_model_len=self.decoder.max_model_len,
                          static_vocab_size=0 if static_ids is None else int(static_ids.shape[0]),
                          static_vocab_sha=self.static_vocab_sha, device=str(self.decoder.target.device),
                          max_prompt_bytes=self.max_prompt_bytes or 0)

    def check_prompt_size(self, prompt: Prompt) -> None:
        """Refuse, without tokenizing, text that cannot fit the context (a prompt of many megabytes would hold a
        tokenizer thread for seconds), and token-id lists longer than the context."""
        limit, context = self.max_prompt_bytes, self.decoder.max_model_len
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
        bad = [m.role for m in prompt.messages if m.role not in CHAT_ROLES]
        if bad:
            raise InvalidRequestError("chat.messages.role", f"must be one of {', '.join(CHAT_ROLES)}; got {bad[0]!r}")
        messages = [{"role": m.role, "content": m.content} for m in prompt.messages]
        return chat_prompt_ids(self.tokenizer, messages, prompt.enable_thinking)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """Validate and queue (raising before the first event: InvalidRequestError, OverloadedError when the
        scheduler's waiting queue is full), then stream TokensEvents and one FinishedEvent. Closing the iterator
        early (client gone) cancels the generation; the scheduler frees it at its next step."""
        start = time.perf_counter()
        request_id = request.request_id or uuid.uuid4().hex
        key = uuid.uuid4().hex  # two requests may carry the same client-chosen id
        self.active[key] = start
        handle = None
        try:
            # Tokenizing (and the chat template) runs on a worker thread: never on the loop that streams the others.
            prompt_ids = await asyncio.to_thread(self.prompt_ids, request.prompt)
            loop = asyncio.get_running_loop()
            events: asyncio.Queue = asyncio.Queue()  # bounded by max_tokens: every event but the last has tokens
            handle = self.scheduler.submit(prompt_ids, request.sampling, request.spec,
                                           lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
            ttft = None
            pending: list[int] = []  # tokens held back by stream_interval
            while True:
                event = await events.get()
                while isinstance(event, TokensOut) and not events.empty():  # sent together: one message
                    pending += event.token_ids
                    event = events.get_nowait()
                if isinstance(event, TokensOut):
                    pending += event.token_ids
                    if ttft is None or len(pending) >= self.stream_interval:
                        ttft = ttft if ttft is not None else time.perf_counter() - start
                        yield TokensEvent(request_id, pending, self.tokenizer.decode(pending))
                        pending = []
                    continue
                if pending:  # the last tokens never wait
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    yield TokensEvent(request_id, pending, self.tokenizer.decode(pending))
                    pending = []
                handle = None  # finished or failed: nothing left to cancel
                if isinstance(event, Failed):
                    raise event.error
                assert isinstance(event, Finished)
                e2e = time.perf_counter() - start
                if self.metrics is not None:
                    self.metrics.record(event.stats, request.spec.method, ttft or 0.0, e2e, event.finish_reason,
                                        request.spec.vocab.dynamic_size)
                stats = {**event.stats.as_dict(), "ttft_seconds": ttft or 0.0, "e2e_seconds": e2e,
                         "method": request.spec.method}
                yield FinishedEvent(request_id, event.finish_reason, stats)
                return
        finally:
            if handle is not None:
                handle.cancel()
            self.active.pop(key, None)
