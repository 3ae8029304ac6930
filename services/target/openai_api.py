"""OpenAI-compatible HTTP front of the target server (docs/openai.md): `POST /v1/chat/completions`,
`POST /v1/completions` (server-sent events or one JSON answer), `GET /v1/models`, `GET /health`, `GET /metrics`.

Like the gRPC front, it only converts: JSON bodies -> the server's typed `GenerateRequest`, its events -> OpenAI's
chunks, our errors -> OpenAI's error JSON with the HTTP status (400 naming the `param`, 401, 404 for an unknown
model, 413, 429 / 503 with Retry-After, 500 with a request id only). The FastAPI app is built per Target replica
(`build_http_app`), so Serve's HTTP proxy and the tests serve the same routes.

Parameters vLLM and OpenAI accept but we cannot honour (n > 1, logprobs, penalties, tools, ...) are refused with a
400 naming them, never silently ignored; fields we do not know are ignored, as OpenAI-compatible servers do.
Speculation rides in the body extension `"speculation": {...}` (vLLM's way to pass extras; openai's `extra_body`).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal, get_args, get_origin

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, create_model
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse

from evospec.config import SEED_SPACE, SPEC_OPTIONS, SamplingParams, SpecParams, spec_field, spec_with, validated
from evospec.errors import (
    EngineStoppedError,
    InvalidRequestError,
    OverloadedError,
    ShuttingDownError,
    UnauthenticatedError,
)
from evospec.services.common.metrics import HttpMetrics
from evospec.services.config import PublicApiConfig
from evospec.services.target.ingress import max_request_bytes
from evospec.services.target.server import (
    ChatMessage,
    FinishedEvent,
    GenerateRequest,
    Prompt,
    TargetServer,
    TokensEvent,
)

log = logging.getLogger("ray.serve")

OPENAI_DEFAULT_TEMPERATURE = 1.0  # OpenAI's default when a request names none (gRPC's is greedy)
CHAT_ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role


UINT32_MAX = 2**32 - 1  # the gRPC API's integer width (evospec.v1): an HTTP integer beyond it is refused, not cut
Uint32 = Annotated[int, Field(ge=0, le=UINT32_MAX)]  # also a token id
# Scalars are strict, declared once here for both routes: "4" is not 4, true is not 1, "yes" is not a boolean (an
# integer is a number, as JSON has it). A value of the wrong JSON type is a 400 naming it, never a guess.
STRICT = ConfigDict(extra="ignore", strict=True)


def speculation_options_model() -> type[BaseModel]:
    """The body extension `speculation`: every flat speculation option (evospec.config.SPEC_OPTIONS) with its typed
    annotation, optional; unset = the service default. Built from the typed config, so a new option needs no line
    here. Integers are bounded by the gRPC API's width; SpecParams checks the rest."""
    def annotation(option: str):
        declared = spec_field(option).annotation
        if declared is int:
            return Uint32
        if get_origin(declared) is tuple:  # a JSON array (strict mode takes only a Python tuple for `tuple`)
            return list[get_args(declared)[0]]
        return declared
    fields = {option: (annotation(option) | None, None) for option in SPEC_OPTIONS}
    return create_model("SpeculationOptions", __config__=ConfigDict(extra="forbid", strict=True), **fields)


SpeculationOptions = speculation_options_model()


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class _CommonRequest(BaseModel):
    """What both endpoints accept, with one rule list (`refuse_unsupported`): unknown fields are ignored (as OpenAI
    and vLLM do); the parameters below that we cannot honour must keep their neutral value, on either route."""
    model_config = STRICT
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-1, le=UINT32_MAX)  # vLLM's extension; -1 = off, as in vLLM
    seed: int | None = Field(None, ge=0, lt=SEED_SPACE)
    stop: str | list[str] | None = None
    stream: bool | None = False  # null = false (some clients send every field)
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False  # vLLM's extension (load tools send it)
    speculation: SpeculationOptions | None = None  # type: ignore[valid-type]
    # The chat route's newer name for max_tokens; honoured on both routes (vLLM does), never silently ignored.
    max_completion_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    # Supported only at their neutral value (refuse_unsupported), on both routes:
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    logprobs: bool | int | None = None  # chat: a boolean; completions: how many
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None
    echo: bool | None = False
    suffix: str | None = None


class ChatRequest(_CommonRequest):
    messages: list[dict[str, Any]]


class CompletionRequest(_CommonRequest):
    prompt: str | list[str] | list[Uint32] | list[list[Uint32]]


def first_unencodable(value: Any, path: str = "body") -> str | None:
    """The path (`messages[0].content`) of the first string in a parsed JSON value that is not valid Unicode text
    (a lone surrogate such as "\\ud800", which JSON can spell but UTF-8 cannot encode), else None. A key that is
    not valid text is reported as its object's path (the key itself could not be written into the error)."""
    if isinstance(value, str):
        return None if _encodable(value) else path
    if isinstance(value, dict):
        for key, item in value.items():
            if not _encodable(key):
                return path
            if found := first_unencodable(item, key if path == "body" else f"{path}.{key}"):
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if found := first_unencodable(item, f"{path}[{i}]"):
                return found
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


DRAIN_FACTOR = 4  # a body over the limit is read (and dropped) up to this many times the limit before the 413
JSON_MEDIA_TYPES = ("application/json",)  # and any application/<x>+json


def refuse_non_json(content_type: str | None) -> None:
    """OpenAIError(415) naming `Content-Type` unless the body is declared JSON. No header at all is read as JSON (as
    FastAPI and vLLM do: minimal clients omit it); text/plain, a form or anything else is refused, not guessed."""
    if content_type is None:
        return
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type in JSON_MEDIA_TYPES or (media_type.startswith("application/") and media_type.endswith("+json")):
        return
    raise OpenAIError(415, f"Content-Type: {media_type or '(empty)'!r} is not JSON; send 'application/json'",
                      "invalid_request_error", "Content-Type")


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def parse_body(data: bytes, model: type[BaseModel]) -> BaseModel:
    """A JSON object as `model`; InvalidRequestError naming the field otherwise."""
    try:
        raw = json.loads(data, parse_constant=_no_constant)  # NaN, Infinity: Python's extension, not JSON
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError; RecursionError: absurdly deep nesting
        raise InvalidRequestError("body", "is not valid JSON (UTF-8, no NaN or Infinity)") from None
    if not isinstance(raw, dict):
        raise InvalidRequestError("body", "must be a JSON object")
    if (where := first_unencodable(raw)) is not None:
        raise InvalidRequestError(where, "holds an unpaired UTF-16 surrogate: not valid Unicode text")
    return validated(model, **raw)


# The server's checks name gRPC fields; an HTTP client is told the OpenAI parameter to fix.
PARAM_OF_FIELD = {"prompt_token_ids": "prompt", "chat.messages.content": "messages", "chat.messages": "messages",
                  "input": "messages", "spec": "speculation", "sampling.max_tokens": "max_tokens"}


def openai_param(field: str) -> str:
    for ours, theirs in PARAM_OF_FIELD.items():
        if field == ours or field.startswith((ours + ".", ours + "[")):
            return theirs + field[len(ours):]
    return field


def refuse_unsupported(body: _CommonRequest) -> None:
    """InvalidRequestError for every parameter we would otherwise have to ignore (both routes: one list)."""
    neutral = {"n": (None, 1), "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0),
               "logit_bias": (None, {}), "best_of": (None, 1), "logprobs": (None, False, 0), "top_logprobs": (None, 0),
               "tools": (None, []), "tool_choice": (None, "none"), "echo": (None, False), "suffix": (None,)}
    why = {"n": "only n = 1 is supported: send n requests", "logprobs": "log-probabilities are not supported",
           "top_logprobs": "log-probabilities are not supported", "tools": "tool calls are not supported",
           "tool_choice": "tool calls are not supported"}
    for name, values in neutral.items():
        value = getattr(body, name)
        if value not in values:  # strict types: no true among the integers, no 1 among the booleans
            raise InvalidRequestError(name, why.get(name, f"is not supported; leave it unset (got {value!r})"))
    fmt = getattr(body, "response_format", None)
    if fmt not in (None, {"type": "text"}):
        raise InvalidRequestError("response_format", "only {\"type\": \"text\"} is supported")


def chat_messages(raw: list[dict[str, Any]]) -> list[ChatMessage]:
    """OpenAI messages -> ours: content is a string or a list of text parts; 'developer' is the system role."""
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise InvalidRequestError(f"messages[{i}]", "must be an object with a role and a content")
        role = m.get("role")  # its value is checked with the gRPC front's messages (TargetServer.prompt_ids)
        if not isinstance(role, str):
            raise InvalidRequestError(f"messages[{i}].role", "must be a string: system, user or assistant")
        role = CHAT_ROLE_ALIASES.get(role, role)
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise InvalidRequestError(f"messages[{i}].content", "only text parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise InvalidRequestError(f"messages[{i}].content", "must be a string or a list of text parts")
        messages.append(ChatMessage(role, content))
    return messages


def completion_prompt(prompt: str | list) -> Prompt:
    """One prompt: a string, or token ids; a list of several prompts is refused (one choice per request)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise InvalidRequestError("prompt", f"has {len(prompt)} prompts; send one per request")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return Prompt(text=prompt)
    if not prompt:
        raise InvalidRequestError("prompt", "is empty")
    return Prompt(token_ids=list(prompt))


def spec_of(options: BaseModel | None, server: TargetServer) -> SpecParams:
    """The request's speculation: the `speculation` options it sets over the service's defaults."""
    values = options.model_dump(exclude_none=True) if options is not None else {}
    return spec_with(server.default_spec, values, name_of=lambda option: f"speculation.{option}")


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    return () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)


class OpenAIError(Exception):
    """An answer in OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code, self.headers = status, kind, param, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def openai_error(exc: BaseException, request_id: str, retry_after_s: int) -> OpenAIError:
    """Our exceptions as OpenAI errors; anything unexpected is a 500 that names only the request id (logged)."""
    retry = {"Retry-After": str(retry_after_s)}
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        param = openai_param(exc.field)
        return OpenAIError(400, f"{param}: {exc.message}", "invalid_request_error", param)
    if isinstance(exc, UnauthenticatedError):
        return OpenAIError(401, "missing or invalid API key: send the header 'Authorization: Bearer <token>'",
                           "authentication_error", code="invalid_api_key")
    if isinstance(exc, (ShuttingDownError, EngineStoppedError)):
        return OpenAIError(503, str(exc), "service_unavailable", headers=retry)
    if isinstance(exc, OverloadedError):
        return OpenAIError(429, str(exc), "rate_limit_exceeded", headers=retry)
    if isinstance(exc, TimeoutError):
        return OpenAIError(504, "the generation timed out; retry", "timeout")
    log.error("request %s failed", request_id, exc_info=exc)
    return OpenAIError(500, f"internal error (request {request_id}); see the server log", "internal_error")


class OpenAIFront:
    """The OpenAI routes over a TargetServer; `metrics` (the replica's /metrics registry) is rendered on a scrape."""

    def __init__(self, server: TargetServer, public: PublicApiConfig, model_name: str,
                 metrics: HttpMetrics | None = None):
        self.server, self.public, self.model_name, self.http_metrics = server, public, model_name, metrics

    # ---- request parsing ------------------------------------------------------------------------------------------
    async def _body(self, request, model: type[BaseModel]) -> BaseModel:
        """The JSON body as `model`, within the size limit; InvalidRequestError / OpenAIError(413, 415) otherwise.
        A body over the limit is still read to its end (up to DRAIN_FACTOR x the limit) before the 413, so a client
        that sends the whole body before it reads the answer gets the 413, not a connection reset."""
        refuse_non_json(request.headers.get("content-type"))
        limit = max_request_bytes()
        declared = request.headers.get("content-length")
        data, size = bytearray(), 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > DRAIN_FACTOR * limit:
                break  # past any honest client: let the connection close
            if size <= limit:
                data += chunk
        if size > limit or (declared is not None and declared.isdigit() and int(declared) > limit):
            raise OpenAIError(413, f"the body is {declared or f'over {limit}'} bytes; at most {limit} are accepted",
                              "invalid_request_error")
        return await asyncio.to_thread(parse_body, bytes(data), model)  # megabytes of JSON: not on the event loop

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(404, f"the model {model!r} does not exist here; this server serves "
                                   f"{self.model_name!r}", "invalid_request_error", "model", "model_not_found")

    async def _generate_request(self, body: _CommonRequest, prompt: Prompt, request_id: str
                                ) -> tuple[GenerateRequest, int]:
        """The typed request and its prompt length. The prompt is tokenized here (on a worker thread) so that an
        unset max_tokens can take `default_max_tokens`, at most the rest of the context."""
        self._check_model(body.model)
        refuse_unsupported(body)
        prompt_ids = await asyncio.to_thread(self.server.prompt_ids, prompt)
        room = self.server.replica.max_model_len - len(prompt_ids)
        if room < 1:
            raise InvalidRequestError("messages" if prompt.messages else "prompt",
                                      f"has {len(prompt_ids)} tokens; the context holds "
                                      f"{self.server.replica.max_model_len}: shorten it")
        max_tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        values = {"max_tokens": getattr(body, max_tokens_param) or min(self.public.default_max_tokens, room),
                  "temperature": OPENAI_DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
                  "ignore_eos": bool(body.ignore_eos)}
        values |= {k: v for k in ("top_p", "top_k", "seed") if (v := getattr(body, k)) is not None}
        if values.get("top_k") == -1:
            values["top_k"] = 0  # vLLM's "off"
        sampling = validated(SamplingParams, **values)
        if sampling.max_tokens > room:
            raise InvalidRequestError(max_tokens_param, f"is {sampling.max_tokens}, but the prompt's "
                                                        f"{len(prompt_ids)} tokens leave {room} of the "
                                                        f"{self.server.replica.max_model_len}-token context")
        return GenerateRequest(Prompt(token_ids=prompt_ids), sampling, spec_of(body.speculation, self.server),
                               request_id, stop_strings(body.stop)), len(prompt_ids)

    # ---- routes ---------------------------------------------------------------------------------------------------
    async def chat_completions(self, request):
        async def parse(request_id: str):
            body = await self._body(request, ChatRequest)
            prompt = Prompt(messages=chat_messages(body.messages))
            return body, *(await self._generate_request(body, prompt, request_id))
        return await self._complete(request, parse, chat=True)

    async def completions(self, request):
        async def parse(request_id: str):
            body = await self._body(request, CompletionRequest)
            return body, *(await self._generate_request(body, completion_prompt(body.prompt), request_id))
        return await self._complete(request, parse, chat=False)

    async def models(self, request):
        try:
            self.server.authorize(request.headers.get("authorization"))
        except Exception as exc:  # noqa: BLE001 - mapped to its status
            return self._error_response(openai_error(exc, "", self.public.retry_after_s))
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": 0, "owned_by": "evospec",
            "max_model_len": self.server.replica.max_model_len}]})

    async def health(self, request):
        """200 while the replica's health predicate holds (TargetServer.health), else 503 with the reason; open, like
        vLLM's /health, for load balancers."""
        problem = self.server.health()
        if problem is not None:
            return JSONResponse({"status": "unavailable", "reason": problem}, status_code=503,
                                headers={"Retry-After": str(self.public.retry_after_s)})
        return JSONResponse({"status": "ok"})

    async def metrics(self, request):
        text = b"" if self.http_metrics is None else \
            await self.http_metrics.render(self.server.replica, self.server.drafts.adapt_stats)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    # ---- generation -----------------------------------------------------------------------------------------------
    async def _complete(self, request, parse, chat: bool):
        """Authorize, parse, start the generation and wait for its first event, so every error that can be known
        before the first token gets its own status; then stream it (SSE) or collect it (one JSON answer)."""
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        events = None
        try:
            self.server.authorize(request.headers.get("authorization"))
            body, typed, prompt_tokens = await parse(request_id)
            events = self.server.generate(typed)
            first = await anext(events)
        except Exception as exc:  # noqa: BLE001 - mapped to its status
            if events is not None:
                await events.aclose()
            return self._error_response(openai_error(exc, request_id, self.public.retry_after_s))
        render = _Render(request_id, self.model_name, chat, prompt_tokens)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return self._streaming(render, first, events, include_usage)
        return await self._collected(render, first, events)

    async def _collected(self, render: "_Render", first, events: AsyncIterator):
        text, completion_tokens, last = [], 0, first
        try:
            async for event in _chain(first, events):
                if isinstance(event, TokensEvent):
                    text.append(event.text)
                    completion_tokens += len(event.token_ids)
                last = event
        except Exception as exc:  # noqa: BLE001 - mapped to its status
            return self._error_response(openai_error(exc, render.request_id, self.public.retry_after_s))
        return JSONResponse(render.whole("".join(text), last, completion_tokens))

    def _streaming(self, render: "_Render", first, events: AsyncIterator, include_usage: bool):
        async def sse() -> AsyncIterator[str]:
            completion_tokens = 0
            try:
                if render.chat:
                    yield _sse(render.chunk({"role": "assistant", "content": ""}))
                async for event in _chain(first, events):
                    if isinstance(event, FinishedEvent):
                        yield _sse(render.chunk(None, event.finish_reason))
                        if include_usage:
                            yield _sse(render.usage_chunk(event, completion_tokens))
                    elif event.text or event.token_ids:
                        completion_tokens += len(event.token_ids)
                        yield _sse(render.chunk(event.text))
            except Exception as exc:  # noqa: BLE001 - the status is sent; the error goes in the stream
                yield _sse(openai_error(exc, render.request_id, self.public.retry_after_s).body())
            finally:
                await events.aclose()  # the client left or the stream ended: the generation is cancelled/freed
            yield "data: [DONE]\n\n"
        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": render.request_id})

    @staticmethod
    def _error_response(error: OpenAIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


class _Render:
    """OpenAI's response objects for one request (chat.completion[.chunk] or text_completion)."""

    def __init__(self, request_id: str, model: str, chat: bool, prompt_tokens: int):
        self.request_id, self.model, self.chat, self.prompt_tokens = request_id, model, chat, prompt_tokens
        self.created = int(time.time())

    def _envelope(self, stream: bool) -> dict:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    def usage(self, finished: FinishedEvent, completion_tokens: int) -> dict:
        """OpenAI's token counts plus our speculative statistics (`speculation`: the public SpecStats fields)."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens, "speculation": finished.stats}

    def chunk(self, text: str | dict | None, finish_reason: str | None = None) -> dict:
        if self.chat:
            delta = text if isinstance(text, dict) else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {**self._envelope(True), "choices": [choice]}

    def usage_chunk(self, finished: FinishedEvent, completion_tokens: int) -> dict:
        return {**self._envelope(True), "choices": [], "usage": self.usage(finished, completion_tokens)}

    def whole(self, text: str, finished: FinishedEvent, completion_tokens: int) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finished.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finished.finish_reason}
        return {**self._envelope(False), "choices": [choice], "usage": self.usage(finished, completion_tokens)}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _chain(first, rest: AsyncIterator) -> AsyncIterator:
    yield first
    async for item in rest:
        yield item


Route = tuple[Literal["GET", "POST"], str, str]
ROUTES: list[Route] = [("POST", "/v1/chat/completions", "chat_completions"), ("POST", "/v1/completions", "completions"),
                       ("GET", "/v1/models", "models"), ("GET", "/health", "health"), ("GET", "/metrics", "metrics")]


def build_http_app(front: OpenAIFront):
    """The FastAPI app of one Target replica (Serve's `__serve_build_asgi_app__`; tests call it directly)."""

    app = FastAPI(title="EvoSpec Serve", description="OpenAI-compatible API (docs/openai.md)", docs_url=None,
                  redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPException)
    async def not_here(request: Request, exc: HTTPException):  # unknown path or method: OpenAI's JSON, not FastAPI's
        paths = ", ".join(f"{m} {p}" for m, p, _ in ROUTES)
        return front._error_response(OpenAIError(exc.status_code, f"{request.method} {request.url.path}: "
                                                 f"{exc.detail}; this server answers {paths}", "invalid_request_error"))
    def endpoint(handler):
        async def route(request: Request):  # FastAPI reads the signature: the request only, no parameters
            return await handler(request)
        return route
    for method, path, name in ROUTES:
        app.add_api_route(path, endpoint(getattr(front, name)), methods=[method], name=name)
    return app
