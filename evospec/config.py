"""Typed request and speculation configuration (pydantic), validated once at the edge.

Invalid values raise `InvalidRequestError(field, message)` through `validated(...)`, never a bare pydantic error.
"""
from __future__ import annotations

import math
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from evospec.errors import InvalidRequestError

Method = Literal["ar", "sd", "frspec", "evospec"]
TreeShape = Literal["chain", "tree"]


class SamplingParams(BaseModel):
    """temperature 0 = greedy. top_k 0 = off. top_p 1.0 = off. seed None = nondeterministic."""
    model_config = ConfigDict(frozen=True, extra="forbid")
    max_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    ignore_eos: bool = False

    @field_validator("temperature", "top_p")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be a finite number")
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
    branching: int = Field(3, ge=1, le=16)
    budget: int = Field(16, ge=1, le=256)

    @property
    def max_nodes(self) -> int:
        return self.num_draft_tokens if self.shape == "chain" else self.budget


class VocabParams(BaseModel):
    """static_size: K most frequent tokens (FR-Spec). dynamic_size: Dyna slots of the EvoSpec buffer."""
    model_config = ConfigDict(frozen=True, extra="forbid")
    static_size: int = Field(32768, ge=1)
    dynamic_size: int = Field(256, ge=0)
    retrieval: tuple[Literal["statistical", "semantic", "target"], ...] = ("statistical", "semantic", "target")


class SpecParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    method: Method = "sd"
    tree: TreeParams = TreeParams()
    vocab: VocabParams = VocabParams()


M = TypeVar("M", bound=BaseModel)


def validated(model: type[M], **values) -> M:
    """Build a config object, turning the first pydantic error into InvalidRequestError naming the field."""
    try:
        return model(**values)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or model.__name__
        raise InvalidRequestError(field, f"{err['msg']} (got {err.get('input')!r})") from None
