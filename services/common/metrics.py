"""Service metrics, recorded once per finished generation, exported two ways from one definition:

- through Ray's metrics API (Ray's metrics agent on each node; Ray prefixes names with `ray_`): `ray_backend`;
- on the Target's own HTTP port, `GET /metrics`, under vLLM's names (`vllm:spec_decode_num_drafts_total`, ...) and
  `evospec:*` for what vLLM has no name for: `prometheus_backend`, a private prometheus_client registry.

vLLM-compatible names and meanings for speculative decoding and latency, plus EvoSpec's own. See docs/metrics.md
for each metric with a PromQL example.
"""
from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable

from evospec.adapt.learner import AdaptStats
from evospec.config import traits
from evospec.engine.stats import SpecStats
from evospec.loading import cpu_description
from evospec.vocab.policy import SOURCES

LATENCY_BUCKETS_S = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0]
STEP_BUCKETS_S = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25]


def ray_backend():
    from ray.util import metrics
    return metrics.Counter, metrics.Histogram, metrics.Gauge


def vllm_name(name: str) -> str:
    """Our metric name as a vLLM dashboard reads it: `evospec_x` -> `evospec:x`, everything else -> `vllm:<name>`."""
    return f"evospec:{name.removeprefix('evospec_')}" if name.startswith("evospec_") else f"vllm:{name}"


class _PrometheusMetric:
    """prometheus_client behind Ray's metric interface (`inc/observe/set(value, tags)`), under the vLLM name, with
    constant labels (vLLM's `model_name`) on every sample."""

    def __init__(self, kind, registry, constant: dict[str, str], name: str, description: str = "",
                 tag_keys: tuple[str, ...] = (), boundaries: list[float] | None = None):
        self.name, self.constant = vllm_name(name), constant
        extra = {"buckets": boundaries} if boundaries is not None else {}
        self.metric = kind(self.name, description or name, labelnames=(*constant, *tag_keys), registry=registry,
                           **extra)

    def _child(self, tags: dict | None):
        return self.metric.labels(**self.constant, **(tags or {}))

    def inc(self, value: float = 1.0, tags: dict | None = None) -> None:
        self._child(tags).inc(value)

    def observe(self, value: float, tags: dict | None = None) -> None:
        self._child(tags).observe(value)

    def set(self, value: float, tags: dict | None = None) -> None:
        self._child(tags).set(value)


def prometheus_backend(registry, constant: dict[str, str]):
    """A backend for ServiceMetrics / AdaptMetrics that writes to `registry` under vLLM's names."""
    import prometheus_client as prom

    def kind(cls):
        return lambda name, **kwargs: _PrometheusMetric(cls, registry, constant, name, **kwargs)
    return lambda: (kind(prom.Counter), kind(prom.Histogram), kind(prom.Gauge))


class ServiceMetrics:
    """One instance per target replica. `record(stats, ...)` once per finished generation."""

    def __init__(self, backend: Callable[[], tuple] = ray_backend):
        Counter, Histogram, Gauge = backend()
        tags = ("method",)
        self.num_drafts = Counter("spec_decode_num_drafts", description="Draft trees verified (one per step).",
                                  tag_keys=tags)
        self.num_draft_tokens = Counter("spec_decode_num_draft_tokens", description="Draft tokens (tree nodes) sent.",
                                        tag_keys=tags)
        self.num_accepted_tokens = Counter("spec_decode_num_accepted_tokens",
                                           description="Draft tokens accepted by the target.", tag_keys=tags)
        self.accepted_per_pos = Counter("spec_decode_num_accepted_tokens_per_pos",
                                        description="Accepted draft tokens by position (tree depth, 0-based).",
                                        tag_keys=(*tags, "position"))
        self.ttft = Histogram("time_to_first_token_seconds", description="Time to first token.",
                              boundaries=LATENCY_BUCKETS_S, tag_keys=tags)
        self.tpot = Histogram("time_per_output_token_seconds", description="Time per output token after the first.",
                              boundaries=LATENCY_BUCKETS_S, tag_keys=tags)
        self.e2e = Histogram("e2e_request_latency_seconds", description="End-to-end request latency.",
                             boundaries=LATENCY_BUCKETS_S, tag_keys=tags)
        self.draft_step = Histogram("evospec_draft_step_seconds", description="Mean draft time per step of a request "
                                    "(tree + transport).", boundaries=STEP_BUCKETS_S, tag_keys=tags)
        self.verify_step = Histogram("evospec_verify_step_seconds", description="Mean target verify time per step.",
                                     boundaries=STEP_BUCKETS_S, tag_keys=tags)
        self.misses = Counter("evospec_draft_vocab_misses", description="Verified target tokens outside the draft's "
                              "active vocabulary A.", tag_keys=tags)
        self.verified_positions = Counter("evospec_verified_positions", description="Verified positions (denominator "
                                          "of the miss rate).", tag_keys=tags)
        self.buffer_updates = Counter("evospec_dynamic_buffer_updates", description="Token ids added to dynamic "
                                      "buffers.", tag_keys=tags)
        self.buffer_hits = Counter("evospec_dynamic_buffer_hits", description="Committed tokens that were in the "
                                   "dynamic buffer when drafted, by the retrieval source that put them there.",
                                   tag_keys=(*tags, "source"))
        self.buffer_size = Gauge("evospec_dynamic_buffer_size", description="Dynamic buffer capacity (Dyna) of the "
                                 "last evospec request.", tag_keys=tags)
        self.fallback_steps = Counter("evospec_draft_fallback_steps", description="Steps speculative requests ran "
                                      "without a tree because their draft failed or was catching up.", tag_keys=tags)
        self.requests_without_draft = Counter("evospec_requests_without_draft", description="Finished "
                                              "speculative requests that ran at least one step target-only because "
                                              "their draft was unavailable (failed, or not yet resumed).",
                                              tag_keys=tags)
        self.draft_resumes = Counter("evospec_draft_resumes", description="Times speculation resumed on a "
                                     "(re)connected draft replica after a fallback.", tag_keys=tags)
        self.predrafted_steps = Counter("evospec_predrafted_steps", description="Draft trees answered from a "
                                        "pre-draft made while the target verified.", tag_keys=tags)
        self.itl = Histogram("inter_token_latency_seconds", description="Time between a request's streamed token "
                             "messages (one per engine step or stream_interval).", boundaries=LATENCY_BUCKETS_S,
                             tag_keys=tags)
        self.prompt_tokens = Counter("prompt_tokens", description="Prompt tokens of finished requests.",
                                     tag_keys=tags)
        self.generated_tokens = Counter("generation_tokens", description="Generated tokens.", tag_keys=tags)
        self.requests = Counter("request_success", description="Finished requests by finish reason.",
                                tag_keys=(*tags, "finished_reason"))

    def record(self, stats: SpecStats, method: str, ttft_s: float, e2e_s: float, finish_reason: str,
               dynamic_size: int = 0, inter_token_s: list[float] = ()) -> None:
        t = {"method": method}
        if stats.drafted:
            self.num_drafts.inc(stats.steps, t)
            self.num_draft_tokens.inc(stats.drafted, t)
            if stats.accepted:
                self.num_accepted_tokens.inc(stats.accepted, t)
            for pos, n in enumerate(stats.accepted_per_pos):
                if n:
                    self.accepted_per_pos.inc(n, {**t, "position": str(pos)})
        self.ttft.observe(ttft_s, t)
        if stats.generated_tokens > 1:
            self.tpot.observe((e2e_s - ttft_s) / (stats.generated_tokens - 1), t)
        self.e2e.observe(e2e_s, t)
        for gap in inter_token_s:
            self.itl.observe(gap, t)
        if stats.steps:
            self.draft_step.observe(stats.draft_seconds / stats.steps, t)
            self.verify_step.observe(stats.verify_seconds / stats.steps, t)
        if stats.verified_positions:
            self.verified_positions.inc(stats.verified_positions, t)
            if stats.misses:
                self.misses.inc(stats.misses, t)
        if stats.buffer_updates:
            self.buffer_updates.inc(stats.buffer_updates, t)
        for source in SOURCES:
            hits = getattr(stats, f"buffer_hits_{source}")
            if hits:
                self.buffer_hits.inc(hits, {**t, "source": source})
        if traits(method).dynamic_buffer:
            self.buffer_size.set(dynamic_size, t)
        if stats.fallback_steps:
            self.fallback_steps.inc(stats.fallback_steps, t)
            self.requests_without_draft.inc(1, t)
        if stats.draft_resumes:
            self.draft_resumes.inc(stats.draft_resumes, t)
        if stats.predrafted_steps:
            self.predrafted_steps.inc(stats.predrafted_steps, t)
        if stats.prompt_tokens:
            self.prompt_tokens.inc(stats.prompt_tokens, t)
        if stats.generated_tokens:
            self.generated_tokens.inc(stats.generated_tokens, t)
        self.requests.inc(1, {**t, "finished_reason": finish_reason})


class HttpMetrics:
    """The Target replica's `GET /metrics`: ServiceMetrics under vLLM's names in a private registry, plus what is
    read at scrape time: the engine's running/waiting queues and a draft replica's adapter version."""

    def __init__(self, model_name: str):
        from prometheus_client import CollectorRegistry, Gauge, disable_created_metrics
        disable_created_metrics()  # no `_created` series, as vLLM's /metrics
        self.registry = CollectorRegistry()
        self.service = ServiceMetrics(prometheus_backend(self.registry, {"model_name": model_name}))
        labels = {"model_name": model_name}
        self.running = Gauge("vllm:num_requests_running", "Generations in the engine's running batch.",
                             labelnames=tuple(labels), registry=self.registry).labels(**labels)
        self.waiting = Gauge("vllm:num_requests_waiting", "Generations waiting for KV memory or a slot.",
                             labelnames=tuple(labels), registry=self.registry).labels(**labels)
        self.without_draft = Gauge("evospec:num_requests_running_without_draft", "Running speculative "
                                   "generations decoding target-only now, by reason: draft_unavailable (their draft "
                                   "failed and has not resumed) or catch_up_deferred (the budget has not bought "
                                   "their draft's catch-up on the context yet).",
                                   labelnames=("model_name", "reason"), registry=self.registry)
        self.adapter_version = Gauge("evospec:adapter_version", "Adapter version a draft replica serves with (0 = "
                                     "the base model), read from one draft replica at scrape time.",
                                     labelnames=("model_name", "mode"), registry=self.registry)
        self.engine_info = Gauge("evospec:engine_info", "1, labelled with what the target computes in (dtype and "
                                 "weight format: auto chooses per machine) and the replica's CPU.",
                                 labelnames=("model_name", "dtype", "weights", "cpu"), registry=self.registry)
        self.model_name = model_name

    async def render(self, replica, adapt_stats: Callable[[], Awaitable[dict]] | None = None,
                     timeout_s: float = 1.0) -> bytes:
        """The registry's text after reading the replica's scheduler queues (`replica`: a TargetReplica) and, when a
        draft replica answers within `timeout_s`, its adapter version (a replica starting or gone: the target's
        metrics still count)."""
        from prometheus_client import generate_latest
        scheduler = replica.scheduler
        self.engine_info.labels(model_name=self.model_name, dtype=replica.dtype, weights=replica.weights,
                                cpu=cpu_description()).set(1)
        self.running.set(scheduler.num_running())
        self.waiting.set(scheduler.num_waiting())
        for reason, count in scheduler.num_without_draft().items():
            self.without_draft.labels(model_name=self.model_name, reason=reason).set(count)
        try:
            adapt = await asyncio.wait_for(adapt_stats(), timeout_s) if adapt_stats is not None else None
        except Exception:  # noqa: BLE001
            adapt = None
        if adapt:
            self.adapter_version.labels(model_name=self.model_name, mode=adapt["mode"]).set(adapt["version"])
        return generate_latest(self.registry)


class AdaptMetrics:
    """One instance per draft replica that adapts online; `record(stats)` every few seconds (the deployment's
    metrics thread): the adapter version serving now, training steps and time, the loss, the learner's memory and
    the teacher signal received."""

    COUNTED = ("train_steps", "train_seconds", "signal_bytes")

    def __init__(self, backend: Callable[[], tuple] = ray_backend):
        Counter, _, Gauge = backend()
        tags = ("mode",)
        self.version = Gauge("evospec_adapter_version", description="Adapter version the draft serves with (0 = the "
                             "base model).", tag_keys=tags)
        self.train_steps = Counter("evospec_adapt_train_steps", description="Online-adaptation training steps.",
                                   tag_keys=tags)
        self.train_seconds = Counter("evospec_adapt_train_seconds", description="Compute time of the adaptation "
                                     "worker.", tag_keys=tags)
        self.signal_bytes = Counter("evospec_adapt_signal_bytes", description="Teacher-signal payload received "
                                    "from the target.", tag_keys=tags)
        self.loss = Gauge("evospec_adapt_loss", description="Moving average of the training loss (weighted KL to the "
                          "target's top-k).", tag_keys=tags)
        self.state_bytes = Gauge("evospec_adapt_state_bytes", description="Memory of the learner: trainable weights, "
                                 "gradients, optimizer state, published copy, replay buffer.", tag_keys=tags)
        self._last: dict[str, float] = {}

    def record(self, stats: AdaptStats) -> None:
        t = {"mode": stats.mode}
        self.version.set(stats.version, t)
        for name in self.COUNTED:
            value = getattr(stats, name)
            delta = value - self._last.get(name, 0)
            if delta > 0:
                getattr(self, name).inc(delta, t)
            self._last[name] = value
        if not math.isnan(stats.loss_ema):
            self.loss.set(stats.loss_ema, t)
        self.state_bytes.set(stats.state_bytes, t)
