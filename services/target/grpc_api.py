"""gRPC front of the target server: the public `evospec.v1.Generate` service. It converts protos to the server's
typed request and its events back to protos, and maps errors to status codes; nothing else."""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, replace

from evospec.config import SpecParams
from evospec.errors import InvalidRequestError
from evospec.services.common.auth import authorization_of
from evospec.services.common.errors import set_status
from evospec.services.common.messages import sampling_from_proto, spec_from_proto, write_field
from evospec.services.target.ingress import UndecodableRequest
from evospec.services.target.server import (
    ChatMessage,
    FinishedEvent,
    GenerateRequest,
    Prompt,
    ServerInfo,
    TargetServer,
)
from evospec.services.target.textstream import checked_stop
from evospec_client.api.v1 import generate_pb2 as pb


def prompt_from_proto(req: pb.GenerateRequest) -> Prompt:
    kind = req.WhichOneof("input")
    if kind is None:
        raise InvalidRequestError("input", "set one of prompt, prompt_token_ids or chat")
    if kind == "prompt":
        return Prompt(text=req.prompt)
    if kind == "prompt_token_ids":
        return Prompt(token_ids=list(req.prompt_token_ids.ids))
    return Prompt(messages=[ChatMessage(m.role, m.content) for m in req.chat.messages],
                  enable_thinking=req.chat.enable_thinking)


def request_from_proto(req: pb.GenerateRequest, default_spec: SpecParams) -> GenerateRequest:
    return GenerateRequest(prompt_from_proto(req), sampling_from_proto(req.sampling),
                           spec_from_proto(req.spec, default_spec), req.request_id,
                           checked_stop(tuple(req.sampling.stop), "sampling.stop"))


def stats_to_proto(stats: dict) -> pb.SpecStats:
    msg = pb.SpecStats()
    for name, value in stats.items():
        write_field(msg, name, value)
    return msg


def finished_to_proto(event: FinishedEvent) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=event.request_id, stats=stats_to_proto(event.stats))
    write_field(msg, "finish_reason", event.finish_reason)
    return msg


def info_to_proto(info: ServerInfo) -> pb.InfoResponse:
    return pb.InfoResponse(**asdict(info))


def checked_message(request, expected: type):
    """The parsed request, or INVALID_ARGUMENT for what the proxy could not parse (ingress.UndecodableRequest)."""
    if isinstance(request, UndecodableRequest):
        raise InvalidRequestError(request.field, request.reason)
    if not isinstance(request, expected):
        raise InvalidRequestError("request", f"must be an {expected.DESCRIPTOR.full_name}")
    return request


class GrpcFront:
    """The RPCs of evospec.v1.Generate over a TargetServer (the Serve deployment forwards its methods here)."""

    def __init__(self, server: TargetServer):
        self.server = server

    def _authorize(self, grpc_context) -> None:
        metadata = grpc_context.invocation_metadata() if grpc_context is not None else ()
        self.server.authorize(authorization_of(metadata))

    async def _responses(self, request: pb.GenerateRequest, grpc_context) -> AsyncIterator[pb.GenerateResponse]:
        request_id = getattr(request, "request_id", "") or uuid.uuid4().hex
        try:
            self._authorize(grpc_context)
            typed = replace(request_from_proto(checked_message(request, pb.GenerateRequest), self.server.default_spec),
                            request_id=request_id)
            async for event in self.server.generate(typed):
                if isinstance(event, FinishedEvent):
                    yield finished_to_proto(event)
                else:
                    yield pb.GenerateResponse(request_id=event.request_id, token_ids=event.token_ids, text=event.text)
        except Exception as exc:
            if grpc_context is not None:
                set_status(grpc_context, exc, request_id)
            raise

    async def Generate(self, request: pb.GenerateRequest, grpc_context=None) -> AsyncIterator[pb.GenerateResponse]:
        async for response in self._responses(request, grpc_context):
            yield response

    async def GenerateOnce(self, request: pb.GenerateRequest, grpc_context=None) -> pb.GenerateResponse:
        token_ids, last = [], None
        async for response in self._responses(request, grpc_context):
            token_ids.extend(response.token_ids)
            last = response
        whole = pb.GenerateResponse(request_id=last.request_id, token_ids=token_ids,
                                    text=self.server.tokenizer.decode(token_ids), stats=last.stats)
        whole.finish_reason, whole.finish_reason_name = last.finish_reason, last.finish_reason_name
        return whole

    async def Info(self, request: pb.InfoRequest, grpc_context=None) -> pb.InfoResponse:
        request_id = uuid.uuid4().hex
        try:
            self._authorize(grpc_context)
            checked_message(request, pb.InfoRequest)
            return info_to_proto(await self.server.info())
        except Exception as exc:
            if grpc_context is not None:
                set_status(grpc_context, exc, request_id)
            raise
