"""Typed configuration of the core (pydantic): requests, speculation and models. Every default lives here, once;
the service configs (services/config.py), the YAMLs and the CLI read them from these types.

Invalid values raise `InvalidRequestError(field, message)` through `validated(...)`, never a bare pydantic error.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from evospec.errors import InvalidRequestError

Method = Literal["ar", "sd", "frspec", "evospec", "lookup"]
METHODS: tuple[str, ...] = get_args(Method)


@dataclass(frozen=True)
class MethodTraits:
    """What a method does: the only place that maps a method's name to behaviour (everything else asks
    `traits(method)`). drafts: a draft model proposes its trees (`ar` is the target alone). static_head: its draft
    head is the static vocabulary S (else every row of the head). dynamic_buffer: it adds EvoSpec's per-generation
    buffer D to S (and with it online retrieval and target-fed candidates). lookup: its chains come from the
    request's own context on the target replica (prompt lookup: engine/lookup.py), no draft model, no draft
    stream."""
    drafts: bool
    static_head: bool = False
    dynamic_buffer: bool = False
    lookup: bool = False


METHOD_TRAITS: dict[str, MethodTraits] = {
    "ar": MethodTraits(drafts=False),
    "sd": MethodTraits(drafts=True),
    "frspec": MethodTraits(drafts=True, static_head=True),
    "evospec": MethodTraits(drafts=True, static_head=True, dynamic_buffer=True),
    "lookup": MethodTraits(drafts=False, lookup=True),
}
assert set(METHOD_TRAITS) == set(METHODS), "every method of Method needs its traits here"
DRAFTING_METHODS: tuple[str, ...] = tuple(m for m in METHODS if METHOD_TRAITS[m].drafts)


def traits(method: str) -> MethodTraits:
    return METHOD_TRAITS[method]

TreeShape = Literal["chain", "tree"]
Retrieval = Literal["statistical", "semantic", "target"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
Quantize = Literal["none", "int8", "int8-weight-only", "int4-weight-only", "int8-per-token", "gguf", "auto"]
SEED_SPACE = 2**64  # seeds are uint64 (the public API's type and torch.Generator's range)
# Sampling temperatures below this divide float32 logits into inf/NaN (1e-39 did); greedy is temperature 0 exactly.
MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 100.0
# Prompt lookup (`lookup`): the earlier occurrence of the context's last LOOKUP_MIN_NGRAM tokens whose match with the
# context runs back furthest (up to LOOKUP_MAX_MATCH tokens; among its LOOKUP_CANDIDATES latest occurrences) proposes
# what followed it there, a chain no longer than its match allows (LOOKUP_CHAIN_BY_MATCH: a match shorter than 4
# tokens proposes 1, shorter than 6 proposes 2, a longer one the step's full depth). Measured on greedy answers of the
# real target (medical-rag, code, chat; docs/results.md, "Prompt lookup" and "Chains as long as their match").
LOOKUP_MIN_NGRAM = 3
LOOKUP_MAX_MATCH = 16
LOOKUP_CANDIDATES = 16
LOOKUP_CHAIN_BY_MATCH: tuple[tuple[int, int], ...] = ((4, 1), (6, 2))  # (match shorter than, longest chain)
MAX_DYNAMIC_SIZE = 4096  # EvoSpec buffer slots a request may ask for (the paper uses 256-1024)


class SamplingParams(BaseModel):
    """temperature 0 = greedy. top_k 0 = off. top_p 1.0 = off. seed None = nondeterministic."""
    model_config = ConfigDict(frozen=True, extra="forbid")
    max_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=0, lt=SEED_SPACE)
    ignore_eos: bool = False

    @field_validator("temperature", "top_p")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @field_validator("temperature")
    @classmethod
    def _greedy_or_stable(cls, v: float) -> float:
        if 0.0 < v < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE}: smaller values overflow the logits")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class TreeParams(BaseModel):
    """Draft tree shape. chain: `num_draft_tokens` tokens in a line. tree: EAGLE-2 style dynamic tree of at most
    `budget` nodes, `depth` levels, each expanded node getting `branching` children, `branching` best nodes
    expanded per level."""
    model_config = ConfigDict(frozen=True, extra="forbid")
    shape: TreeShape = "chain"
    num_draft_tokens: int = Field(4, ge=1, le=64)
    depth: int = Field(4, ge=1, le=16)
    branching: int = Field(2, ge=1, le=16)
    budget: int = Field(8, ge=1, le=256)

    @property
    def max_nodes(self) -> int:
        return self.num_draft_tokens if self.shape == "chain" else self.budget

    @property
    def levels(self) -> int:
        """Levels of the deepest tree of this shape (a chain's length): the draft depth it asks for."""
        return self.num_draft_tokens if self.shape == "chain" else self.depth

    @property
    def width(self) -> int:
        """Children per expanded node, and nodes expanded (forwarded) per level: 1 for a chain."""
        return 1 if self.shape == "chain" else self.branching


def clipped_size(params: TreeParams, k: int) -> tuple[int, int]:
    """(depth, most nodes) of the request's shape cut to k levels: `clip_depth` without building it (the budget
    evaluates this for every request and depth, every step)."""
    if k <= 0:
        return 0, 0
    depth = min(k, params.levels)
    if params.shape == "chain":
        return depth, depth
    b = params.branching
    return depth, min(params.budget, b + (depth - 1) * b * b)


@functools.lru_cache(maxsize=1024)  # shapes are frozen (hashable) and few; this runs for every drafting request
def clip_depth(params: TreeParams, k: int) -> TreeParams:
    """The request's shape cut to at most k >= 1 levels (and the node budget such a tree can use)."""
    depth, nodes = clipped_size(params, k)
    if params.shape == "chain":
        return params.model_copy(update={"num_draft_tokens": depth})
    return params.model_copy(update={"depth": depth, "budget": nodes})


class VocabParams(BaseModel):
    """static_size: K most frequent tokens (FR-Spec). dynamic_size: Dyna slots of the EvoSpec buffer."""
    model_config = ConfigDict(frozen=True, extra="forbid")
    static_size: int = Field(32768, ge=1)  # at most the loaded static vocabulary's size (checked by the server)
    dynamic_size: int = Field(256, ge=0, le=MAX_DYNAMIC_SIZE)
    retrieval: tuple[Retrieval, ...] = get_args(Retrieval)

    @field_validator("retrieval")
    @classmethod
    def _canonical(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        """A set, in one order: requests naming the same sources share one policy (and one cache entry)."""
        return tuple(r for r in get_args(Retrieval) if r in v)


class SpecParams(BaseModel):
    """The speculation of one request; these defaults are the service's defaults too."""
    model_config = ConfigDict(frozen=True, extra="forbid")
    method: Method = "evospec"
    tree: TreeParams = TreeParams()
    vocab: VocabParams = VocabParams()
    # A decoupled draft drafts the likeliest outcomes' next trees while the target verifies (greedy requests only;
    # docs/decoupled.md). An in-process draft has nothing to overlap with and ignores it.
    predraft: bool = True

    @property
    def speculative(self) -> bool:
        """A draft model drafts the trees (`sd`, `frspec`, `evospec`; not `ar`, not `lookup`)."""
        return traits(self.method).drafts


class ModelConfig(BaseModel):
    """One model of the pair. path None = the embedded tiny pair. device auto = CUDA when available, else CPU;
    dtype auto = bfloat16 on CUDA and on CPUs with native bf16 (AVX512-BF16, AMX), float32 on other CPUs (chosen at
    load: evospec/loading.py; the embedded tiny pair stays float32, the reference its exact tests compare with).
    torch_threads None = leave torch's (or Ray's) choice (Ray sets one thread for a replica with num_cpus 0).
    quantize: the weight format (evospec/model/weight_formats.py, docs/models.md "Weight formats"): none (dense, in
    dtype), int8 (dynamic int8 decoder layers; CPU, float32; a draft's format: its output is only proposed),
    int8-weight-only / int4-weight-only / int8-per-token (CPU; row-invariant, so greedy speculation stays the
    target's own; int8-per-token is SmoothQuant-smoothed, calibrated once per model), gguf (CPU with AVX2 and a C
    compiler: the source GGUF's own Q4_K/Q6_K blocks through kernels/kquant.c, row-invariant), auto (the default:
    none on a GPU and for the embedded tiny pair, else the fastest of these measured at load; int4 and gguf only for
    a model converted from a 4-bit GGUF)."""
    model_config = ConfigDict(frozen=True, extra="forbid")
    path: str | None = None
    device: str = "auto"
    dtype: DType = "auto"
    torch_threads: int | None = Field(None, ge=1)
    # Pin the process that runs this model to these CPU ids (Linux; None = no pinning): on a CPU deployment, giving
    # the draft and the target replicas their own cores keeps their threads from competing (docs/decoupled.md).
    cpu_affinity: tuple[int, ...] | None = None
    quantize: Quantize = "auto"

    @model_validator(mode="after")
    def _quantized_formats_run_on_the_cpu(self) -> "ModelConfig":
        if self.quantize == "int8" and (self.dtype not in ("auto", "float32") or self.device.startswith("cuda")):
            raise ValueError("quantize: int8 runs a float32 model on the CPU; set dtype float32 and device cpu")
        cpu_only = ("int8-weight-only", "int4-weight-only", "int8-per-token", "gguf")
        if self.quantize in cpu_only and self.device.startswith("cuda"):
            raise ValueError(f"quantize: {self.quantize} runs on the CPU only; use none or auto on {self.device}")
        return self


class SchedulerConfig(BaseModel):
    """The continuous-batching scheduler of one target replica (evospec/engine/scheduler.py).

    kv_tokens: the target's KV arena, in tokens, shared by every running generation (each reserves prompt +
    max_tokens + one tree). draft_kv_tokens: the same for an in-process draft (None = kv_tokens). max_running:
    generations stepped together. max_waiting: admitted requests queued for KV or a running slot; beyond it,
    RESOURCE_EXHAUSTED. prefill_chunk: prompt tokens prefilled per engine step over all generations, so a long prompt
    delays the others' next tokens by at most one chunk. adaptive: choose each step's draft depth from measured step
    costs and acceptance (goodput); off = every request drafts its full tree (the per-request loop's behaviour).
    draft_retry_s / draft_max_retry_s: after its draft failed, a running generation tries to resume speculation
    (a new draft session, prefilled with everything committed so far) after draft_retry_s, doubling up to
    draft_max_retry_s while it keeps failing. stall_timeout_s: one engine step running longer than this makes the
    replica unhealthy (a hung forward; Serve then replaces it): above the slowest legitimate step, a full
    prefill chunk of a large target on a slow CPU. draft_prefill: when a speculative request's draft session prefills
    its prompt. deferred: after the target's prefill, in chunks, while the request already decodes target-only, so
    speculation never delays the first token (its first steps have no tree). with_target: in the same engine steps
    as the target's prefill, before the first token (the per-request loop's order; tests compare seeded samples with
    it). lookup_fallback (with `adaptive`): a request of a draft-model method verifies a prompt-lookup chain
    (engine/lookup.py) in the steps its draft proposes no tree (the budget chose not to draft, its draft is catching
    up or lost), where the budget finds that it pays: lossless, and next to free where a draft level is not (a CPU).
    """
    model_config = ConfigDict(frozen=True, extra="forbid")
    kv_tokens: int = Field(32768, ge=16)
    draft_kv_tokens: int | None = Field(None, ge=16)
    max_running: int = Field(64, ge=1)
    max_waiting: int = Field(256, ge=0)
    prefill_chunk: int = Field(256, ge=1)
    adaptive: bool = True
    draft_retry_s: float = Field(1.0, gt=0)
    draft_max_retry_s: float = Field(16.0, gt=0)
    stall_timeout_s: float = Field(180.0, gt=0)
    draft_prefill: Literal["deferred", "with_target"] = "deferred"
    lookup_fallback: bool = True


AdaptMode = Literal["off", "lora", "full"]
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class AdaptConfig(BaseModel):
    """Online adaptation of the draft while it serves (EvoSpec's third part; evospec/adapt, docs/adaptation.md).

    mode: off | lora (low-rank adapters on the decoder projections `modules` of the last `layers` decoder layers
    (0 = all), rank `rank`, scale alpha/rank; the base weights, int8 or float, stay frozen) | full (every
    decoder-layer parameter with its AdamW state: the full-parameter online-distillation baseline, as in OSD; float
    drafts only). With LoRA on the last layers only, the frozen layers below are run once per example and their
    output is kept with it, so a training step costs the adapted layers' forward and backward alone. The embeddings and the LM head are never
    trained, so the static and dynamic head rows the draft scores stay exact copies of the model it serves with.
    teacher_top_k: the target's top-k log-probabilities sent per verified position (the distillation signal).
    window: tokens per training example (context + positions with a teacher signal); positions_per_example: teacher
    positions a session collects before they become one example. replay_size / replay_mb: the replay buffer's bound
    (examples, and bytes). batch_size: examples per training step; min_examples: replay size before training starts.
    publish_every: training steps per published version (the update interval); a version is swapped in between two
    draft steps. train_threads: torch threads of the training worker; max_time_share: share of wall time the worker
    may compute (it sleeps the rest, so serving keeps the cores). focus_start: curriculum, the share of positions
    (highest KL first) the loss starts on; it widens to all as the loss falls (docs/adaptation.md). memory_cap_mb:
    the learner's state (trainable copy, gradients, optimizer, published version, replay buffer) must fit, checked
    when it starts. checkpoint: adapter file restored at start when it exists and saved every checkpoint_every
    versions (0 = only on `evospec adapt export`)."""
    model_config = ConfigDict(frozen=True, extra="forbid")
    mode: AdaptMode = "off"
    rank: int = Field(8, ge=1, le=256)
    alpha: float = Field(16.0, gt=0)
    modules: tuple[str, ...] = LORA_MODULES
    layers: int = Field(4, ge=0)
    lr: float = Field(2e-4, gt=0)
    teacher_top_k: int = Field(8, ge=1, le=64)
    window: int = Field(128, ge=8, le=4096)
    positions_per_example: int = Field(32, ge=1)
    replay_size: int = Field(256, ge=1)
    replay_mb: float = Field(64.0, gt=0)
    batch_size: int = Field(4, ge=1)
    min_examples: int = Field(2, ge=1)
    publish_every: int = Field(2, ge=1)
    train_threads: int = Field(1, ge=1)
    max_time_share: float = Field(0.25, gt=0, le=1)
    focus_start: float = Field(0.25, gt=0, le=1)
    memory_cap_mb: float = Field(4096.0, gt=0)
    checkpoint: str | None = None
    checkpoint_every: int = Field(0, ge=0)
    seed: int = 0

    @field_validator("modules")
    @classmethod
    def _known_modules(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        unknown = sorted(set(v) - set(LORA_MODULES))
        if unknown or not v:
            raise ValueError(f"modules must be a non-empty subset of {LORA_MODULES}; unknown {unknown}")
        return v

    @model_validator(mode="after")
    def _window_holds_an_example(self) -> "AdaptConfig":
        if self.positions_per_example >= self.window:
            raise ValueError(f"positions_per_example ({self.positions_per_example}) must be below window "
                             f"({self.window}): an example needs context before its positions")
        return self

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


def draft_seed(seed: int) -> int:
    """The draft's generator seed for a request seeded with `seed`: different from the target's, same range."""
    return (seed + 1) % SEED_SPACE


M = TypeVar("M", bound=BaseModel)


UNION_MEMBER_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "tuple"}


def validated(model: type[M], /, **values) -> M:
    """Build a config object, turning the first pydantic error into InvalidRequestError naming the field."""
    try:
        return model(**values)
    except ValidationError as e:
        def path_of(err) -> list:  # a union's error names the member type it tried (`stop.str`): keep the field path
            return [p for p in err["loc"] if not (isinstance(p, str) and (p in UNION_MEMBER_TAGS or "[" in p))]
        # The deepest error names the exact element: of `stop: str | list[str]` given ["a", 2], `stop[1]` (the
        # list member's complaint), not `stop` (the str member's).
        err = max(e.errors(), key=lambda err: len(path_of(err)))
        path = path_of(err)
        field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".") or model.__name__
        got = repr(err.get("input"))
        got = got if len(got) <= 200 else got[:200] + "..."  # never echo a huge input back
        raise InvalidRequestError(field, f"{err['msg']} (got {got})") from None


# ---- the public field list --------------------------------------------------------------------------------------
# Clients name a request's speculation options flat: the gRPC SpecParams (with its TreeParams), the OpenAI body's
# `speculation` object, the SDK's keyword arguments and the CLI's flags all use these names. Each is a field of
# SpecParams or of one of its parts, so a new option is declared once, here in the typed config (plus its proto
# line); every front derives its list from SPEC_OPTIONS.
SPEC_PARTS: dict[str, type[BaseModel]] = {"tree": TreeParams, "vocab": VocabParams}


def _spec_options() -> dict[str, tuple[str, ...]]:
    paths: dict[str, tuple[str, ...]] = {}
    for name in SpecParams.model_fields:
        part = SPEC_PARTS.get(name)
        paths.update({sub: (name, sub) for sub in part.model_fields} if part is not None else {name: (name,)})
    return paths


SPEC_OPTIONS: dict[str, tuple[str, ...]] = _spec_options()  # flat option name -> its path in SpecParams


def spec_field(option: str):
    """The pydantic FieldInfo of a flat speculation option (its type, default and bounds)."""
    path = SPEC_OPTIONS[option]
    model = SPEC_PARTS[path[0]] if len(path) == 2 else SpecParams
    return model.model_fields[path[-1]]


def spec_options(spec: SpecParams) -> dict[str, object]:
    """`spec` as flat options (the inverse of `spec_with`)."""
    values = spec.model_dump()
    out = {}
    for option, path in SPEC_OPTIONS.items():
        value = values
        for key in path:
            value = value[key]
        out[option] = value
    return out


def spec_with(defaults: SpecParams, options: dict[str, object], name_of=lambda option: option) -> SpecParams:
    """The request's speculation: `options` (flat names; None = unset) over the server's `defaults`. An invalid value
    raises InvalidRequestError naming `name_of(option)`, the front's own name for it."""
    values = defaults.model_dump()
    for option, value in options.items():
        if value is None:
            continue
        if option not in SPEC_OPTIONS:
            raise InvalidRequestError(name_of(option), f"is not a speculation option; the options are "
                                                       f"{', '.join(SPEC_OPTIONS)}")
        *parents, key = SPEC_OPTIONS[option]
        target = values
        for parent in parents:
            target = target[parent]
        target[key] = value
    try:
        return validated(SpecParams, **values)
    except InvalidRequestError as e:
        parts = e.field.split(".")  # e.g. tree.depth, vocab.retrieval[0], method
        option, bracket, index = (parts[1] if parts[0] in SPEC_PARTS and len(parts) > 1 else parts[0]).partition("[")
        name = name_of(option) + bracket + index if option in SPEC_OPTIONS else e.field
        raise InvalidRequestError(name, e.message) from None
