"""method -> the vocabulary policy it drafts with (`VocabPolicies`), built from its traits (`evospec.config.traits`:
does it draft, with which head, with a dynamic buffer: pure data, which everything else asks)."""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Executor
from dataclasses import dataclass, replace

import torch
from torch import nn

from evospec.config import SpecParams, traits
from evospec.errors import InvalidRequestError
from evospec.vocab.active import full_vocab, static_vocab
from evospec.vocab.policy import (
    EvoSpecPolicy,
    EvoSpecSettings,
    FixedVocabPolicy,
    VocabPolicy,
    buffer_worker,
    trained_rows,
)
from evospec.vocab.retrieval import CoocIndex, EmbeddingIndex


@dataclass(frozen=True)
class ActiveLayout:
    """What the target must know of a method's A to mirror it: the static prefix (None = every row), the number of
    dynamic slots, and whether the draft wants target-fed buffer candidates."""
    static_ids: torch.Tensor | None
    dynamic_size: int
    target_feedback: bool


class VocabPolicies:
    """Builds each (method, sizes) policy once and caches it: gathering head rows is done once per server. Requests
    choose the sizes, so the cache is bounded: least recently used policies are dropped beyond `max_cache_bytes`
    (sessions that use a dropped policy keep it until they end)."""

    def __init__(self, head_weight: torch.Tensor | None, static_ids: torch.Tensor | None,
                 cooc: CoocIndex | None = None, evospec: EvoSpecSettings = EvoSpecSettings(),
                 max_cache_bytes: int = 512 << 20, quantized_head: nn.Module | None = None):
        self.head_weight = head_weight
        self.quantized_head = quantized_head  # the draft's quantized LM head (static blocks gather its rows), if any
        self.static_ids = static_ids  # ranked by frequency, most frequent first
        self.cooc = cooc
        self.evospec = evospec  # server-wide EvoSpec settings; requests choose sizes and retrieval sources
        self.max_cache_bytes = max_cache_bytes
        self._cache: OrderedDict[tuple, tuple[VocabPolicy, int]] = OrderedDict()  # key -> (policy, bytes)
        self._index: EmbeddingIndex | None = None  # built on first use, shared by every EvoSpec policy
        self._worker: Executor | None = None
        self._lock = threading.Lock()

    def _static_prefix(self, k: int) -> torch.Tensor:
        if self.static_ids is None:
            raise InvalidRequestError("spec.method", "needs a static vocabulary; start the server with one "
                                                     "(`evospec vocab build`)")
        if k > self.static_ids.shape[0]:
            raise InvalidRequestError("spec.vocab.static_size",
                                      f"{k} exceeds the {self.static_ids.shape[0]} ids of the loaded static vocabulary")
        return self.static_ids[:k]

    def layout(self, spec: SpecParams) -> ActiveLayout:
        """The shape of A for `spec`, without building anything; raises InvalidRequestError if it cannot be served
        (the target validates and mirrors requests whose draft runs in another process)."""
        v, method = spec.vocab, traits(spec.method)
        if not method.drafts:
            raise InvalidRequestError("spec.method", f"'{spec.method}' has no draft vocabulary")
        static_ids = self._static_prefix(v.static_size) if method.static_head else None
        if method.dynamic_buffer:
            return ActiveLayout(static_ids, v.dynamic_size, "target" in v.retrieval)
        return ActiveLayout(static_ids, 0, False)

    def get(self, spec: SpecParams) -> VocabPolicy:
        key = (spec.method, spec.vocab.static_size, spec.vocab.dynamic_size, spec.vocab.retrieval)
        with self._lock:  # requests validate (and so build) from several threads
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key][0]
            policy = self._build(spec)
            self._cache[key] = (policy, self._policy_bytes(spec))
            while len(self._cache) > 1 and self.cache_bytes() > self.max_cache_bytes:
                self._cache.popitem(last=False)
            return policy

    def cache_bytes(self) -> int:
        return sum(size for _, size in self._cache.values())

    def _policy_bytes(self, spec: SpecParams) -> int:
        """What a policy holds: its gathered static head rows (none for a full head, which the model's own matrix
        is) and, with a dynamic buffer, per-vocabulary-id tables (a bool mask and a Python list: ~9 bytes per id)."""
        if self.head_weight is None:
            return 0
        vocab, hidden = self.head_weight.shape
        method = traits(spec.method)
        rows = min(spec.vocab.static_size, vocab) if method.static_head else 0
        return rows * hidden * self.head_weight.element_size() + (9 * vocab if method.dynamic_buffer else 0)

    def with_evospec(self, settings: EvoSpecSettings) -> "VocabPolicies":
        """The same vocabularies with other server-wide EvoSpec settings, sharing the index and the worker."""
        other = VocabPolicies(self.head_weight, self.static_ids, self.cooc, settings, self.max_cache_bytes,
                              self.quantized_head)
        other._index, other._worker = self._index, self._worker
        return other

    def _build(self, spec: SpecParams) -> VocabPolicy:
        layout = self.layout(spec)
        if traits(spec.method).dynamic_buffer:
            v = spec.vocab
            settings = replace(self.evospec, dynamic_size=v.dynamic_size,
                               use_statistical="statistical" in v.retrieval, use_semantic="semantic" in v.retrieval,
                               use_target=layout.target_feedback)
            if settings.use_semantic and self._index is None:
                self._index = EmbeddingIndex(self.head_weight, trained_rows(self.head_weight).nonzero()[:, 0])
            if settings.update_lag and self._worker is None:
                self._worker = buffer_worker()
            return EvoSpecPolicy(self.head_weight, layout.static_ids, settings, self.cooc, self._index, self._worker,
                                 self.quantized_head)
        active = full_vocab(self.head_weight) if layout.static_ids is None \
            else static_vocab(self.head_weight, layout.static_ids, self.quantized_head)
        return FixedVocabPolicy(active, self.head_weight.shape[0])
