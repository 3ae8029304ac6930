"""method name -> vocabulary policy. The only place that maps method strings to behaviour."""
from __future__ import annotations

import threading
from concurrent.futures import Executor
from dataclasses import dataclass, replace

import torch

from evospec.config import SpecParams
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
    """Builds each (method, sizes) policy once and caches it: gathering head rows is done once per server."""

    def __init__(self, head_weight: torch.Tensor | None, static_ids: torch.Tensor | None,
                 cooc: CoocIndex | None = None, evospec: EvoSpecSettings = EvoSpecSettings()):
        self.head_weight = head_weight
        self.static_ids = static_ids  # ranked by frequency, most frequent first
        self.cooc = cooc
        self.evospec = evospec  # server-wide EvoSpec settings; requests choose sizes and retrieval sources
        self._cache: dict[tuple, VocabPolicy] = {}
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
        v = spec.vocab
        if spec.method == "sd":
            return ActiveLayout(None, 0, False)
        if spec.method == "frspec":
            return ActiveLayout(self._static_prefix(v.static_size), 0, False)
        if spec.method == "evospec":
            return ActiveLayout(self._static_prefix(v.static_size), v.dynamic_size, "target" in v.retrieval)
        raise InvalidRequestError("spec.method", f"'{spec.method}' has no draft vocabulary")

    def get(self, spec: SpecParams) -> VocabPolicy:
        key = (spec.method, spec.vocab.static_size, spec.vocab.dynamic_size, spec.vocab.retrieval)
        with self._lock:  # requests validate (and so build) from several threads
            if key not in self._cache:
                self._cache[key] = self._build(spec)
            return self._cache[key]

    def with_evospec(self, settings: EvoSpecSettings) -> "VocabPolicies":
        """The same vocabularies with other server-wide EvoSpec settings, sharing the index and the worker."""
        other = VocabPolicies(self.head_weight, self.static_ids, self.cooc, settings)
        other._index, other._worker = self._index, self._worker
        return other

    def _build(self, spec: SpecParams) -> VocabPolicy:
        layout = self.layout(spec)
        if spec.method == "evospec":
            v = spec.vocab
            settings = replace(self.evospec, dynamic_size=v.dynamic_size,
                               use_statistical="statistical" in v.retrieval, use_semantic="semantic" in v.retrieval,
                               use_target=layout.target_feedback)
            if settings.use_semantic and self._index is None:
                self._index = EmbeddingIndex(self.head_weight, trained_rows(self.head_weight).nonzero()[:, 0])
            if settings.update_lag and self._worker is None:
                self._worker = buffer_worker()
            return EvoSpecPolicy(self.head_weight, layout.static_ids, settings, self.cooc, self._index, self._worker)
        active = full_vocab(self.head_weight) if layout.static_ids is None \
            else static_vocab(self.head_weight, layout.static_ids)
        return FixedVocabPolicy(active, self.head_weight.shape[0])
