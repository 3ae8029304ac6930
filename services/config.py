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
    {draft_slot: 1} with `ray start --resources='{"draft_slot": 1}'`. health_check_period_s / health_check_timeout_s:
    how often Serve calls the replica's check_health (the deployment's health predicate, services/common/health.py)
    and how long it waits for it (Serve's defaults); a replica failing it is replaced."""
    model_config = ConfigDict(frozen=True, extra="forbid")
    num_replicas: int = Field(1, ge=1)
    num_gpus: float = Field(1.0, ge=0)
    num_cpus: float = Field(1.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)
    health_check_period_s: float = Field(10.0, gt=0)
    health_check_timeout_s: float = Field(30.0, gt=0)


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
    startup_wait_s: how long a starting target replica waits for them to answer (it serves target-only meanwhile).
    costs_timeout_s: limit of the start-up call that times a draft replica's forwards (the budget's prior; about a
    second on a CPU; past it the budget keeps its guess and learns from its first steps).
    secret: sent with every call to the draft replicas (their InternalStreamConfig.secret)."""
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
    costs_timeout_s: float = Field(30.0, gt=0)
    secret: str | None = Field(None, repr=False)  # the draft's InternalStreamConfig.secret (set by the app builder)


class InternalStreamConfig(BaseModel):
    """The draft replica's speculation stream server (docs/security.md). secret: the application's shared secret;
    every call (Health included) must carry `authorization: Bearer <secret>`, else UNAUTHENTICATED. The app builder
    sets it (from EVOSPEC_INTERNAL_SECRET, or a fresh random one per deployment) on both deployments; None = no
    authentication (tests on loopback only: the Draft deployment refuses to start without one). max_streams:
    concurrent calls the server accepts (one per target replica, plus probes); more get RESOURCE_EXHAUSTED.
    max_sessions_per_stream: sessions one caller may hold open. idle_timeout_s: a stream that sends nothing this long
    is closed and its sessions freed."""
    model_config = ConfigDict(frozen=True, extra="forbid")
    secret: str | None = Field(None, repr=False, min_length=16)
    max_streams: int = Field(16, ge=1)
    max_sessions_per_stream: int = Field(256, ge=1)
    idle_timeout_s: float = Field(300.0, gt=0)


class PublicApiConfig(BaseModel):
    """The public evospec.v1 API of the Target deployment (docs/security.md).

    Bearer tokens: the comma-separated tokens in the environment variable `auth_tokens_env`, plus `auth_tokens`
    (prefer the variable: config files travel). With any token set, Generate, GenerateOnce and Info need the metadata
    `authorization: Bearer <token>` (UNAUTHENTICATED otherwise); Health stays open for load balancers.
    max_prompt_bytes: None = derived from the context, max_model_len x the longest token in bytes: a prompt longer than
    that cannot fit in the context, so it is refused before it is tokenized.
    stream_interval: tokens per streamed message after the first (vLLM's --stream-interval): 1 sends every step's
    tokens at once; more sends fewer, larger messages, which saves the proxy's per-message work (docs/decoupled.md).
    Tokens already waiting are always sent together, and the first token and the last never wait.

    The OpenAI-compatible HTTP front (docs/openai.md) uses the same tokens (header `Authorization: Bearer <token>`)
    and limits. served_model_name: the `model` it lists and accepts (None = the target model folder's name).
    default_max_tokens: what a request without max_tokens may generate, at most the rest of the context (every
    running request reserves KV for its max_tokens, so "the whole context" by default would starve concurrency).
    retry_after_s: the Retry-After of its 429 (overloaded) and 503 (shutting down) answers."""
    model_config = ConfigDict(frozen=True, extra="forbid")
    auth_tokens: tuple[str, ...] = Field((), repr=False)
    auth_tokens_env: str = "EVOSPEC_API_TOKENS"
    max_prompt_bytes: int | None = Field(None, ge=1)
    stream_interval: int = Field(1, ge=1, le=1024)
    served_model_name: str | None = Field(None, min_length=1)
    default_max_tokens: int = Field(1024, ge=1)
    retry_after_s: int = Field(1, ge=1)


class DraftServiceConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    model: ModelConfig = ModelConfig()
    replica: ReplicaConfig = ReplicaConfig()
    static_vocab: str | None = None  # None = the committed Spec-Bench 32k artifact (must be the target's too)
    cooc: str | None = None  # None = the committed PubMedQA co-occurrence index
    internal_host: str | None = None  # address the speculation stream server binds and advertises; None = node IP
    adapt: AdaptConfig = AdaptConfig()  # online adaptation of this deployment's draft (off by default)
    internal: InternalStreamConfig = InternalStreamConfig()  # authentication and limits of the speculation stream
    policy_cache_mb: float = Field(512.0, gt=0)  # vocabulary policies (head rows per method and sizes), LRU-evicted
    # KV slots all open draft sessions may hold (each has its own cache): about 4 target replicas' default arenas.
    # A session beyond it is refused (RESOURCE_EXHAUSTED): its generation runs target-only and retries later.
    max_kv_tokens: int = Field(131072, ge=1024)
    # Overlap: while the target verifies a tree, pre-draft the next tree for this many of its likeliest outcomes
    # (greedy requests that keep spec.predraft on; 0 = never). docs/decoupled.md has the measured choice.
    predraft_hypotheses: int = Field(4, ge=0, le=16)


class TargetServiceConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    model: ModelConfig = ModelConfig()
    replica: ReplicaConfig = ReplicaConfig()
    static_vocab: str | None = None  # None = the committed Spec-Bench 32k artifact (must be the draft's too)
    max_model_len: int | None = Field(None, ge=2)  # None = the model's max_position_embeddings
    default_spec: SpecParams = SpecParams()  # what a request that names no method/shape/sizes gets
    scheduler: SchedulerConfig = SchedulerConfig()  # continuous batching: KV arena, running/waiting limits, chunking
    draft_link: DraftLinkConfig = DraftLinkConfig()  # finding, timing out and reconnecting draft replicas
    public: PublicApiConfig = PublicApiConfig()  # authentication and size limits of the public API
