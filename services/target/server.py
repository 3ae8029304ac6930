"""Transport-free target server: admission, generation as an async iterator of typed events, metrics and info.

Fronts convert their wire types to `GenerateRequest` and the events back: the gRPC front today
(services/target/grpc_api.py), an HTTP front next; a batching scheduler replaces the per-request step loop behind
`generate` without touching either. Raises InvalidRequestError (the field to fix) and OverloadedError; nothing here
imports gRPC or Ray.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Protocol

from evospec.config import METHODS, SamplingParams, SpecParams
from evospec.engine.drafter import DrafterFactory, DraftRequest
from evospec.engine.generate import SpeculativeDecoder
from evospec.engine.stats import SpecStats
from evospec.errors import InvalidRequestError, OverloadedError
from evospec.loading import apply_torch_threads, load_model, load_static_ids, stop_token_ids
from evospec.services.config import TargetServiceConfig
from evospec.services.target.threaded import iterate_in_thread
from evospec.tokenizer import chat_prompt_ids, load_tokenizer
from evospec.vocab.registry import ActiveLayout

CHAT_ROLES = ("system", "user", "assistant")


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


class DraftPool(Protocol):
    """Where speculative generations get their drafters (services/target/remote_draft.py: RemoteDraftPool)."""

    async def connect(self) -> None: ...

    def open(self, session_id: str, request: DraftRequest, layout: ActiveLayout, vocab_size: int,
             static_vocab_sha: str): ...


class MetricsSink(Protocol):
    def record(self, stats: SpecStats, method: str, ttft_s: float, e2e_s: float, finish_reason: str,
               dynamic_size: int = 0) -> None: ...


@dataclass
class DraftSide:
    """The draft as the target sees it: a pool for the data plane, and control-plane queries (Serve handles)."""
    pool: DraftPool
    model_name: Callable[[], Awaitable[str]]
    num_sessions: Callable[[], Awaitable[int]]


@dataclass
class TargetServer:
    decoder: SpeculativeDecoder
    tokenizer: object
    drafts: DraftSide
    default_spec: SpecParams = SpecParams()
    max_concurrent_generations: int = 64
    static_vocab_sha: str = ""
    model_name: str = ""
    metrics: MetricsSink | None = None
    active: dict[str, float] = field(default_factory=dict)  # request id -> start time

    @classmethod
    def from_config(cls, cfg: TargetServiceConfig, drafts: DraftSide, metrics: MetricsSink | None = None
                    ) -> "TargetServer":
        apply_torch_threads(cfg.model.torch_threads)
        model, folder = load_model(cfg.model, "target")
        static_ids, sha = load_static_ids(cfg.static_vocab)
        decoder = SpeculativeDecoder(model, None, static_ids=static_ids, max_model_len=cfg.max_model_len,
                                     eos_ids=stop_token_ids(folder))
        return cls(decoder, load_tokenizer(str(folder)), drafts, cfg.default_spec, cfg.max_concurrent_generations,
                   sha, str(Path(folder)), metrics)

    def num_sessions(self) -> int:
        return len(self.active)

    async def info(self) -> ServerInfo:
        static_ids = self.decoder.policies.static_ids
        return ServerInfo(version=version("evospec-serve"), draft_model=await self.drafts.model_name(),
                          target_model=self.model_name, methods=list(METHODS),
                          default_method=self.default_spec.method, max_model_len=self.decoder.max_model_len,
                          static_vocab_size=0 if static_ids is None else int(static_ids.shape[0]),
                          static_vocab_sha=self.static_vocab_sha, device=str(self.decoder.target.device))

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """Token ids of the prompt; InvalidRequestError names the field to fix."""
        given = [x is not None for x in (prompt.text, prompt.token_ids, prompt.messages)]
        if sum(given) != 1:
            raise InvalidRequestError("input", "set exactly one of prompt, prompt_token_ids or chat")
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

    def _admit(self) -> None:
        if len(self.active) >= self.max_concurrent_generations:
            raise OverloadedError(f"{len(self.active)} generations running (max_concurrent_generations="
                                  f"{self.max_concurrent_generations}); retry later")

    async def _drafter_factory(self, request_id: str) -> DrafterFactory:
        await self.drafts.pool.connect()
        vocab_size = self.decoder.target.vocab_size
        layout_of = self.decoder.policies.layout
        return lambda req: self.drafts.pool.open(request_id, req, layout_of(req.spec), vocab_size,
                                                 self.static_vocab_sha)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """Validate and admit (raising before the first event), then stream TokensEvents and one FinishedEvent.
        Closing the iterator early (client gone) stops the generation after its current step and frees it."""
        start = time.perf_counter()
        self._admit()
        request_id = request.request_id or uuid.uuid4().hex
        key = uuid.uuid4().hex  # two requests may carry the same client-chosen id
        self.active[key] = start
        try:
            prompt_ids = self.prompt_ids(request.prompt)
            speculative = request.spec.method != "ar"
            factory = await self._drafter_factory(request_id) if speculative else None
            gen = self.decoder.generate(prompt_ids, request.sampling, request.spec, drafter_factory=factory)
            ttft = None
            async for chunk in iterate_in_thread(iter(gen), name=f"gen-{request_id[:8]}"):
                ttft = ttft if ttft is not None else time.perf_counter() - start
                yield TokensEvent(request_id, chunk.token_ids, self.tokenizer.decode(chunk.token_ids))
            e2e = time.perf_counter() - start
            finish_reason = gen.finish_reason or ""
            if self.metrics is not None:
                self.metrics.record(gen.stats, request.spec.method, ttft or 0.0, e2e, finish_reason,
                                    request.spec.vocab.dynamic_size)
            stats = {**gen.stats.as_dict(), "ttft_seconds": ttft or 0.0, "e2e_seconds": e2e,
                     "method": request.spec.method}
            yield FinishedEvent(request_id, finish_reason, stats)
        finally:
            self.active.pop(key, None)
