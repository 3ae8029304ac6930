"""Typed configuration of the two deployments. Each deployment receives only its own part; defaults of requests
and models come from the core types (evospec/config.py); the application config (orchestration/config.py) composes
these two with the Serve-level settings.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from evospec.config import AdaptConfig, ModelConfig, SchedulerConfig, SpecParams

# Largest internal gRPC message (a sampled tree carries a draft distribution over A per expanded node).
INTERNAL_MAX_MESSAGE_BYTES = 64 << 20
INTERNAL_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", INTERNAL_MAX_MESSAGE_BYTES),
                            ("grpc.max_send_message_length", INTERNAL_MAX_MESSAGE_BYTES)]


class ReplicaConfig(BaseModel):
    """Ray actor options of a deployment's replicas. Production asks one GPU each; on a CPU-only machine the local
    runner starts Ray with logical GPUs so the same placement schedules. resources pins to nodes, e.g.
    {draft_slot: 1} with `ray start --resources='{"draft_slot": 1}'`."""
    model_config = ConfigDict(frozen=True, extra="forbid")
    num_replicas: int = Field(1, ge=1)
    num_gpus: float = Field(1.0, ge=0)
    num_cpus: float = Field(1.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)


class DraftLinkConfig(BaseModel):
    """How a target replica reaches the draft replicas (services/target/draft_link.py).

    step_timeout_s / prefill_token_s: a draft replica's reply to an engine step is late after step_timeout_s, or 3x
    what that replica usually takes for such a step when that is longer (its measured step time, and its time per
    prefilled context token, prefill_token_s until measured); the target then marks the replica failed and runs its
    sessions target-only. So a slow but alive replica (a big batch, a CPU prefill chunk) is waited for, a frozen one
    is not. max_step_timeout_s caps that wait, whatever was measured. probe_timeout_s: limit of one discovery call
    or health probe. refresh_s: how often the replicas are rediscovered through Serve (at once after a failure). retry_s / max_retry_s: a failed replica is
    probed again after retry_s, doubling up to max_retry_s; it takes sessions again once a probe answers SERVING.
    replicas: how many draft replicas to look for (the app builder sets it from draft.replica.num_replicas).
    startup_wait_s: how long a starting target replica waits for them to answer (it serves target-only meanwhile)."""
    model_config = ConfigDict(frozen=True, extra="forbid")
    step_timeout_s: float = Field(1.0, gt=0)
    prefill_token_s: float = Field(0.005, ge=0)
    max_step_timeout_s: float = Field(10.0, gt=0)
    probe_timeout_s: float = Field(2.0, gt=0)
    refresh_s: float = Field(5.0, gt=0)
    retry_s: float = Field(0.5, gt=0)
    max_retry_s: float = Field(8.0, gt=0)
    replicas: int = Field(1, ge=1)
    startup_wait_s: float = Field(60.0, ge=0)


class DraftServiceConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    model: ModelConfig = ModelConfig()
    replica: ReplicaConfig = ReplicaConfig()
    static_vocab: str | None = None  # None = the committed Spec-Bench 32k artifact (must be the target's too)
    cooc: str | None = None  # None = the committed PubMedQA co-occurrence index
    internal_host: str | None = None  # address the speculation stream server binds and advertises; None = node IP
    adapt: AdaptConfig = AdaptConfig()  # online adaptation of this deployment's draft (off by default)


class TargetServiceConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    model: ModelConfig = ModelConfig()
    replica: ReplicaConfig = ReplicaConfig()
    static_vocab: str | None = None  # None = the committed Spec-Bench 32k artifact (must be the draft's too)
    max_model_len: int | None = Field(None, ge=2)  # None = the model's max_position_embeddings
    default_spec: SpecParams = SpecParams()  # what a request that names no method/shape/sizes gets
    scheduler: SchedulerConfig = SchedulerConfig()  # continuous batching: KV arena, running/waiting limits, chunking
    internal_timeout_s: float = Field(600.0, gt=0)  # deadline of a per-generation draft stream (per-request loop)
    draft_link: DraftLinkConfig = DraftLinkConfig()  # finding, timing out and reconnecting draft replicas
