"""Target Ray Serve deployment: the public `evospec.v1.Generate` service (Serve gRPC ingress) and the driver of
each generation. It holds the authoritative sequence, verifies each tree, and talks to the draft replica over one
bidi stream per generation (services/target/remote_draft.py). Methods are named like the RPCs, as Serve requires.
"""
from __future__ import annotations

import logging
import time
import uuid

import grpc
from ray import serve

from evospec.api.evospec.v1 import generate_pb2 as gen_pb
from evospec.engine.generate import SpeculativeDecoder
from evospec.errors import OverloadedError
from evospec.loading import QWEN3_STOP_IDS, load_model, load_static_ids
from evospec.tokenizer import load_tokenizer
from orchestration.config import AppConfig, apply_torch_threads
from services.common.convert import prompt_ids_from_request, sampling_from_proto, spec_from_proto, stats_to_proto
from services.common.errors import set_status
from services.common.metrics import ServiceMetrics
from services.target.remote_draft import RemoteDrafter
from services.target.threaded import iterate_in_thread

log = logging.getLogger("ray.serve")
VERSION = "0.1.0"
METHODS = ["ar", "sd", "frspec", "evospec"]


@serve.deployment(name="Target")
class TargetDeployment:
    def __init__(self, draft, config: dict):
        self.cfg = AppConfig(**config)
        apply_torch_threads(self.cfg.target.torch_threads)
        model, folder = load_model(self.cfg.target.path, "target", self.cfg.target.device, self.cfg.target.dtype)
        self.tokenizer = load_tokenizer(str(folder))
        self.static_ids, self.static_sha = load_static_ids(self.cfg.static_vocab)
        self.decoder = SpeculativeDecoder(model, None, static_ids=self.static_ids,
                                          max_model_len=self.cfg.max_model_len, eos_ids=QWEN3_STOP_IDS)
        self.model_name = str(folder)
        self.draft_handle = draft
        self._channel: grpc.Channel | None = None
        self.active: dict[str, float] = {}  # request id -> start time
        self.metrics = ServiceMetrics()

    async def _draft_channel(self) -> grpc.Channel:
        if self._channel is None:
            address = await self.draft_handle.address.remote()
            self._channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20),
                                                                    ("grpc.max_send_message_length", 64 << 20)])
        return self._channel

    def _start(self, request: gen_pb.GenerateRequest, channel: grpc.Channel):
        """Validate and build the lazy generation (raises InvalidRequestError / OverloadedError)."""
        if len(self.active) >= self.cfg.max_concurrent_generations:
            raise OverloadedError(f"{len(self.active)} generations running (max_concurrent_generations="
                                  f"{self.cfg.max_concurrent_generations}); retry later")
        request_id = request.request_id or uuid.uuid4().hex
        sampling = sampling_from_proto(request.sampling)
        spec = spec_from_proto(request.spec, self.cfg.default_spec)
        prompt_ids = prompt_ids_from_request(request, self.tokenizer)

        def remote(prompt, sampling_, spec_, max_len, seed):
            return RemoteDrafter(channel, request_id, prompt, sampling_, spec_, max_len, seed,
                                 self.decoder.policies.layout(spec_),
                                 self.decoder.target.vocab_size, self.static_sha, self.cfg.internal_timeout_s)
        gen = self.decoder.generate(prompt_ids, sampling, spec, drafter_factory=remote)
        return request_id, spec, gen

    async def _run(self, request, grpc_context):
        """Async iterator of GenerateResponse; errors become gRPC statuses via grpc_context."""
        start = time.perf_counter()
        try:
            channel = await self._draft_channel()
            request_id, spec, gen = self._start(request, channel)
        except Exception as exc:
            if grpc_context is not None:
                set_status(grpc_context, exc)
            raise
        self.active[request_id] = start
        ttft = None
        try:
            async for chunk in iterate_in_thread(iter(gen), name=f"gen-{request_id[:8]}"):
                ttft = ttft if ttft is not None else time.perf_counter() - start
                yield gen_pb.GenerateResponse(request_id=request_id, token_ids=chunk.token_ids,
                                              text=self.tokenizer.decode(chunk.token_ids))
            e2e = time.perf_counter() - start
            stats = stats_to_proto(gen.stats, spec.method, ttft or 0.0, e2e)
            self.metrics.record(gen.stats, spec.method, ttft or 0.0, e2e, gen.finish_reason or "",
                                spec.vocab.dynamic_size)
            yield gen_pb.GenerateResponse(request_id=request_id, finish_reason=gen.finish_reason or "", stats=stats)
        except Exception as exc:
            if grpc_context is not None:
                set_status(grpc_context, exc)
            raise
        finally:
            self.active.pop(request_id, None)

    async def Generate(self, request: gen_pb.GenerateRequest, grpc_context=None):
        async for response in self._run(request, grpc_context):
            yield response

    async def GenerateOnce(self, request: gen_pb.GenerateRequest, grpc_context=None) -> gen_pb.GenerateResponse:
        token_ids, last = [], None
        async for response in self._run(request, grpc_context):
            token_ids.extend(response.token_ids)
            last = response
        return gen_pb.GenerateResponse(request_id=last.request_id, token_ids=token_ids,
                                       text=self.tokenizer.decode(token_ids), finish_reason=last.finish_reason,
                                       stats=last.stats)

    async def Info(self, request: gen_pb.InfoRequest, grpc_context=None) -> gen_pb.InfoResponse:
        draft_name = await self.draft_handle.model.remote()
        return gen_pb.InfoResponse(version=VERSION, draft_model=draft_name, target_model=self.model_name,
                                   methods=METHODS, default_method=self.cfg.default_spec.method,
                                   max_model_len=self.decoder.max_model_len,
                                   static_vocab_size=int(self.static_ids.shape[0]), static_vocab_sha=self.static_sha,
                                   device=str(self.decoder.target.device))

    async def Check(self, request, grpc_context=None):
        """grpc.health.v1.Health/Check, routed here by Serve's gRPC proxy."""
        from grpc_health.v1 import health_pb2
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    async def num_sessions(self) -> dict:
        """Live generations on both sides (for tests and operators)."""
        return {"target": len(self.active), "draft": await self.draft_handle.num_sessions.remote()}

    def __del__(self):
        if getattr(self, "_channel", None) is not None:
            self._channel.close()
