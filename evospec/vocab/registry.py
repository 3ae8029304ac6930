"""method name -> vocabulary policy. The only place that maps method strings to behaviour."""
from __future__ import annotations

import torch

from evospec.config import SpecParams
from evospec.errors import InvalidRequestError
from evospec.vocab.policy import EvoSpecPolicy, EvoSpecSettings, FullVocabPolicy, StaticVocabPolicy, VocabPolicy
from evospec.vocab.retrieval import CoocIndex


class VocabPolicies:
    """Builds each (method, sizes) policy once and caches it: gathering head rows is done once per server."""

    def __init__(self, head_weight: torch.Tensor | None, static_ids: torch.Tensor | None,
                 cooc: CoocIndex | None = None):
        self.head_weight = head_weight
        self.static_ids = static_ids  # ranked by frequency, most frequent first
        self.cooc = cooc
        self._cache: dict[tuple, VocabPolicy] = {}

    def _static_prefix(self, k: int) -> torch.Tensor:
        if self.static_ids is None:
            raise InvalidRequestError("spec.method", "needs a static vocabulary; start the server with one "
                                                     "(`evospec vocab build`)")
        if k > self.static_ids.shape[0]:
            raise InvalidRequestError("spec.vocab.static_size",
                                      f"{k} exceeds the {self.static_ids.shape[0]} ids of the loaded static vocabulary")
        return self.static_ids[:k]

    def check(self, spec: SpecParams) -> None:
        """Raise InvalidRequestError if `spec` cannot be served, without building anything (the target validates
        requests whose draft runs in another process)."""
        if spec.method in ("frspec", "evospec"):
            self._static_prefix(spec.vocab.static_size)

    def get(self, spec: SpecParams) -> VocabPolicy:
        key = (spec.method, spec.vocab.static_size, spec.vocab.dynamic_size, spec.vocab.retrieval)
        if key not in self._cache:
            self._cache[key] = self._build(spec)
        return self._cache[key]

    def _build(self, spec: SpecParams) -> VocabPolicy:
        if spec.method == "sd":
            return FullVocabPolicy(self.head_weight)
        if spec.method == "frspec":
            return StaticVocabPolicy(self.head_weight, self._static_prefix(spec.vocab.static_size))
        if spec.method == "evospec":
            v = spec.vocab
            settings = EvoSpecSettings(dynamic_size=v.dynamic_size, use_statistical="statistical" in v.retrieval,
                                       use_semantic="semantic" in v.retrieval, use_target="target" in v.retrieval)
            return EvoSpecPolicy(self.head_weight, self._static_prefix(v.static_size), settings, self.cooc)
        raise InvalidRequestError("spec.method", f"'{spec.method}' is not available in this build")
