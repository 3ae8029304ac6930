"""EvoSpec Serve client SDK: sync and async clients over the public gRPC API.

    from evospec_client import EvoSpecClient
    with EvoSpecClient("127.0.0.1:9000") as c:
        for delta in c.stream(messages=[{"role": "user", "content": "Is aspirin useful after a stroke?"}]):
            print(delta.text, end="")
        print(delta.stats)          # the last delta carries finish_reason and per-request speculative stats

Every call has one deadline (`timeout`), retries included. Retries (`retries`, exponential backoff from `backoff_s`): only UNAVAILABLE
(what a restarting target replica answers: "target restarting, retry"), and only before the first response arrived.
So unary calls (`info`, `generate_once`) are retried whole, a stream only if it produced nothing yet: a generation
that started is never silently replayed.
"""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict

from evospec_client.api.v1 import generate_pb2 as pb
from evospec_client.api.v1 import generate_pb2_grpc as pb_grpc
from evospec_client.enums import LEGACY_SUFFIX, enum_number, enum_string
from evospec_client.errors import DeadlineExceeded, InvalidArgument, NotFound, Unavailable, from_rpc_error


@dataclass
class Delta:
    """One streamed message: new token ids and text; finish_reason and stats on the last one."""
    token_ids: list[int]
    text: str
    finish_reason: str = ""
    stats: dict = field(default_factory=dict)
    request_id: str = ""


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: dict
    request_id: str


# Where each request option lives in evospec.v1, read from the messages themselves: a field added to the proto is an
# option here with no change to this file. Spec options are flat (shape, depth, ... as on the server's other fronts).
OPTION_MESSAGES = (("sampling", pb.SamplingParams), ("spec", pb.SpecParams), ("spec.tree", pb.TreeParams))


def option_paths() -> dict[str, str]:
    """{option: path of the message that holds it} for every request option the public messages have."""
    paths = {}
    for path, message in OPTION_MESSAGES:
        for proto_field in message.DESCRIPTOR.fields:
            if proto_field.message_type is None and not proto_field.name.endswith(LEGACY_SUFFIX):
                paths.setdefault(proto_field.name, path)
    return paths


OPTIONS = option_paths()


def _set_option(request: pb.GenerateRequest, option: str, value) -> None:
    """Set one option on its message; a value the message cannot hold raises InvalidArgument naming the field."""
    path = OPTIONS[option]
    message = request
    for part in path.split("."):
        message = getattr(message, part)
    field = message.DESCRIPTOR.fields_by_name[option]
    try:
        if field.enum_type is not None:
            setattr(message, option, enum_number(field.enum_type, value))
        elif field.is_repeated:
            getattr(message, option).extend([value] if isinstance(value, str) else value)
        else:
            setattr(message, option, value)
    except (ValueError, TypeError) as e:
        raise InvalidArgument(f"{path}.{option}: {e}") from None


def build_request(prompt: str | None = None, messages: list[dict] | None = None,
                  prompt_token_ids: list[int] | None = None, *, enable_thinking: bool = False,
                  tree: dict | None = None, request_id: str = "", **options) -> pb.GenerateRequest:
    """A GenerateRequest from exactly one input and any request options by name (None or unset = the server's
    default): the sampling ones (max_tokens, temperature, top_p, top_k, seed, ignore_eos, stop) and the speculation
    ones (method, shape, num_draft_tokens, depth, branching, budget, static_size, dynamic_size, retrieval, predraft);
    `tree` = the tree options as a dict. Unknown names raise TypeError; values out of the wire's range raise
    InvalidArgument naming the field."""
    given = [x is not None for x in (prompt, messages, prompt_token_ids)]
    if sum(given) != 1:
        raise ValueError("pass exactly one of prompt, messages or prompt_token_ids")
    options = {**(tree or {}), **options}
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"unknown request option(s) {', '.join(unknown)}; the options are {', '.join(OPTIONS)}")
    req = pb.GenerateRequest(request_id=request_id)
    for option, value in options.items():
        if value is not None and value != "":
            _set_option(req, option, value)
    field = "prompt" if prompt is not None else "prompt_token_ids" if prompt_token_ids is not None else "chat"
    try:
        if prompt is not None:
            req.prompt = prompt
        elif prompt_token_ids is not None:
            req.prompt_token_ids.ids.extend(prompt_token_ids)
        else:
            req.chat.CopyFrom(pb.Chat(messages=[pb.ChatMessage(**m) for m in messages],
                                      enable_thinking=enable_thinking))
    except (ValueError, TypeError) as e:  # a value the wire cannot hold (an id of -1, a message's unknown key)
        raise InvalidArgument(f"{field}: {e}") from None
    return req


TOKEN_ENV = "EVOSPEC_API_TOKEN"


def call_metadata(app_name: str, token: str | None = None) -> tuple[tuple[str, str], ...]:
    """Serve's routing key, plus the bearer token (`token`, else $EVOSPEC_API_TOKEN) when there is one."""
    token = token or os.environ.get(TOKEN_ENV)
    return (("application", app_name),) + ((("authorization", f"Bearer {token}"),) if token else ())


def _enum_string(msg, name: str) -> str:
    """An enum field as the server's string ("evospec", "length"), from the enum or, from a server built before it,
    its string form `<name>_name`; "" when unset."""
    field = msg.DESCRIPTOR.fields_by_name[name]
    return enum_string(field.enum_type, getattr(msg, name)) or getattr(msg, name + LEGACY_SUFFIX, "")


def _stats(msg: pb.GenerateResponse) -> dict:
    """The statistics as a plain dict, enums as their strings (stats["method"] == "evospec")."""
    if not msg.HasField("stats"):
        return {}
    stats = _as_dict(msg.stats, always_print_fields_with_no_presence=True)
    for stat in msg.stats.DESCRIPTOR.fields:
        if stat.enum_type is not None:
            stats[stat.name] = _enum_string(msg.stats, stat.name)
            stats.pop(stat.name + LEGACY_SUFFIX, None)
    return stats


def _delta(msg: pb.GenerateResponse) -> Delta:
    return Delta(list(msg.token_ids), msg.text, _enum_string(msg, "finish_reason"), _stats(msg), msg.request_id)


def _completion(msg: pb.GenerateResponse) -> Completion:
    d = _delta(msg)
    return Completion(d.token_ids, d.text, d.finish_reason, d.stats, d.request_id)


def _info(msg: pb.InfoResponse) -> dict:
    return _as_dict(msg)


INT64_TYPES = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
               FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}


def _as_dict(msg, **options) -> dict:
    """A flat message as a plain dict under its proto field names, every field its Python type: protobuf's JSON
    mapping writes 64-bit integers as strings (JSON numbers lose precision past 2**53), which a Python caller
    should not see (`info()["max_prompt_bytes"]` is an int)."""
    values = MessageToDict(msg, preserving_proto_field_name=True, **options)
    for proto_field in msg.DESCRIPTOR.fields:
        if proto_field.type in INT64_TYPES and proto_field.name in values:
            value = values[proto_field.name]
            values[proto_field.name] = [int(v) for v in value] if isinstance(value, list) else int(value)
    return values


# What a service that is still deploying answers: no app yet (NOT_FOUND), its replica still loading (a deadline).
NOT_READY = (Unavailable, NotFound, DeadlineExceeded)


def _retry_delay(error: Exception, started: bool, attempt: int, retries: int, backoff_s: float,
                 deadline: float) -> float | None:
    """The one retry rule of both clients: UNAVAILABLE before the first message, with exponential backoff, while the
    call's deadline leaves room; None = give up (a generation that started is never silently replayed)."""
    delay = backoff_s * 2**attempt
    if isinstance(error, Unavailable) and not started and attempt < retries and time.monotonic() + delay < deadline:
        return delay
    return None


def _collect(deltas) -> Completion:
    ids, text, last = [], [], None
    for d in deltas:
        ids += d.token_ids
        text.append(d.text)
        last = d
    return Completion(ids, "".join(text), last.finish_reason, last.stats, last.request_id)


class EvoSpecClient:
    def __init__(self, address: str, timeout: float = 120.0, app_name: str = "evospec", retries: int = 3,
                 backoff_s: float = 0.5, token: str | None = None, tls_root_cert: bytes | None = None,
                 tls: bool = False):
        """token: the service's bearer token when it requires one (default: $EVOSPEC_API_TOKEN). tls: connect with
        TLS (its TLS port), verifying against `tls_root_cert` (PEM bytes; None = the system's roots)."""
        self.address, self.timeout, self.retries, self.backoff_s = address, timeout, retries, backoff_s
        self.metadata = call_metadata(app_name, token)
        self._channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(tls_root_cert)) \
            if tls or tls_root_cert else grpc.insecure_channel(address)
        self._stub = pb_grpc.GenerateStub(self._channel)

    def __enter__(self) -> "EvoSpecClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def stream(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs) -> Iterator[Delta]:
        """Stream a generation. kwargs: see `build_request`. Raises client.errors.* on failure."""
        request = build_request(prompt, **kwargs)
        deadline = time.monotonic() + (timeout or self.timeout)  # one deadline for the call, retries included
        for attempt in range(self.retries + 1):
            call = self._stub.Generate(request, timeout=deadline - time.monotonic(), metadata=self.metadata)
            started = False
            try:
                for msg in call:
                    started = True
                    yield _delta(msg)
                return
            except grpc.RpcError as err:
                error = from_rpc_error(err)
                delay = _retry_delay(error, started, attempt, self.retries, self.backoff_s, deadline)
                if delay is None:
                    raise error from None
                time.sleep(delay)
            finally:
                call.cancel()  # no-op when finished; frees server state when the caller stops early

    def generate(self, prompt: str | None = None, **kwargs) -> Completion:
        """The whole answer (streamed underneath, so the server's per-token path is the same)."""
        return _collect(self.stream(prompt, **kwargs))

    def generate_once(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs) -> Completion:
        """Unary GenerateOnce RPC."""
        request = build_request(prompt, **kwargs)
        return _completion(self._unary(self._stub.GenerateOnce, request, timeout or self.timeout))

    def info(self, timeout: float = 10.0) -> dict:
        return _info(self._unary(self._stub.Info, pb.InfoRequest(), timeout))

    def _unary(self, method, request, timeout: float, retries: int | None = None):
        deadline = time.monotonic() + timeout
        retries = self.retries if retries is None else retries
        for attempt in range(retries + 1):
            try:
                return method(request, timeout=deadline - time.monotonic(), metadata=self.metadata)
            except grpc.RpcError as err:
                error = from_rpc_error(err)
                delay = _retry_delay(error, False, attempt, retries, self.backoff_s, deadline)
                if delay is None:
                    raise error from None
                time.sleep(delay)

    def wait_ready(self, timeout: float = 60.0) -> dict:
        """Poll Info until the service answers; after `timeout`, raise the last error (Unavailable, NotFound or
        DeadlineExceeded: what a service that is still deploying answers)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return _info(self._unary(self._stub.Info, pb.InfoRequest(), 5.0, retries=0))  # this loop retries
            except NOT_READY:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


class AsyncEvoSpecClient:
    """asyncio twin of EvoSpecClient: same constructor and call arguments, same retry rule, `async for` streaming."""

    def __init__(self, address: str, timeout: float = 120.0, app_name: str = "evospec", retries: int = 3,
                 backoff_s: float = 0.5, token: str | None = None, tls_root_cert: bytes | None = None,
                 tls: bool = False):
        self.address, self.timeout, self.retries, self.backoff_s = address, timeout, retries, backoff_s
        self.metadata = call_metadata(app_name, token)
        self._channel = grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(tls_root_cert)) \
            if tls or tls_root_cert else grpc.aio.insecure_channel(address)
        self._stub = pb_grpc.GenerateStub(self._channel)

    async def __aenter__(self) -> "AsyncEvoSpecClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def stream(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs
                     ) -> AsyncIterator[Delta]:
        """Stream a generation. kwargs: see `build_request`. Raises evospec_client errors on failure."""
        request = build_request(prompt, **kwargs)
        deadline = time.monotonic() + (timeout or self.timeout)  # one deadline for the call, retries included
        for attempt in range(self.retries + 1):
            call = self._stub.Generate(request, timeout=deadline - time.monotonic(), metadata=self.metadata)
            started = False
            try:
                async for msg in call:
                    started = True
                    yield _delta(msg)
                return
            except grpc.RpcError as err:
                error = from_rpc_error(err)
                delay = _retry_delay(error, started, attempt, self.retries, self.backoff_s, deadline)
                if delay is None:
                    raise error from None
                await asyncio.sleep(delay)
            finally:
                call.cancel()

    async def generate(self, prompt: str | None = None, **kwargs) -> Completion:
        return _collect([d async for d in self.stream(prompt, **kwargs)])

    async def generate_once(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs
                            ) -> Completion:
        """Unary GenerateOnce RPC."""
        request = build_request(prompt, **kwargs)
        return _completion(await self._unary(self._stub.GenerateOnce, request, timeout or self.timeout))

    async def info(self, timeout: float = 10.0) -> dict:
        return _info(await self._unary(self._stub.Info, pb.InfoRequest(), timeout))

    async def _unary(self, method, request, timeout: float, retries: int | None = None):
        deadline = time.monotonic() + timeout
        retries = self.retries if retries is None else retries
        for attempt in range(retries + 1):
            try:
                return await method(request, timeout=deadline - time.monotonic(), metadata=self.metadata)
            except grpc.RpcError as err:
                error = from_rpc_error(err)
                delay = _retry_delay(error, False, attempt, retries, self.backoff_s, deadline)
                if delay is None:
                    raise error from None
                await asyncio.sleep(delay)

    async def wait_ready(self, timeout: float = 60.0) -> dict:
        """Poll Info until the service answers; after `timeout`, raise the last error (Unavailable, NotFound or
        DeadlineExceeded: what a service that is still deploying answers)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return _info(await self._unary(self._stub.Info, pb.InfoRequest(), 5.0, retries=0))
            except NOT_READY:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
