"""Typed service configuration (pydantic). YAML files in orchestration/configs/ load into `AppConfig`."""
from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field

from evospec.config import SpecParams, TreeParams, VocabParams


class ModelSpec(BaseModel):
    """path None = the embedded tiny pair. Resources are Ray actor options of the model's deployment."""
    model_config = ConfigDict(extra="forbid")
    path: str | None = None
    device: str = "auto"  # auto = cuda when available, else cpu
    dtype: str = "auto"  # auto = bfloat16 on cuda, float32 on cpu
    num_gpus: float = 1.0
    num_cpus: float = 1.0
    resources: dict[str, float] = Field(default_factory=dict)  # e.g. {draft_slot: 1} to pin to a node
    # CPU threads for torch in the replica. Ray sets OMP_NUM_THREADS from num_cpus (1 when num_cpus is 0), which
    # silently halves CPU speed on a 2-core box; None keeps Ray's choice.
    torch_threads: int | None = None


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    app_name: str = "evospec"
    draft: ModelSpec = ModelSpec()
    target: ModelSpec = ModelSpec()
    static_vocab: str | None = None  # None = the committed Spec-Bench 32k artifact
    cooc: str | None = None  # None = the committed PubMedQA co-occurrence index
    max_model_len: int | None = None
    default_spec: SpecParams = SpecParams(method="evospec", tree=TreeParams(shape="chain", num_draft_tokens=4),
                                          vocab=VocabParams(static_size=32768, dynamic_size=256))
    max_ongoing_requests: int = 128  # Serve's default 5 collapses streaming throughput
    max_concurrent_generations: int = 64  # beyond this the target answers RESOURCE_EXHAUSTED
    internal_host: str | None = None  # address the draft's stream server binds/advertises; None = Ray node IP
    internal_timeout_s: float = 600.0  # deadline of each draft<->target stream
    graceful_shutdown_timeout_s: float = 5.0
    grpc_port: int = 9000
    http_port: int = 8000

    @classmethod
    def from_yaml(cls, path: str | Path) -> "AppConfig":
        return cls(**(yaml.safe_load(Path(path).read_text()) or {}))


CONFIG_DIR = Path(__file__).parent / "configs"


def apply_torch_threads(threads: int | None) -> None:
    if threads:
        import torch
        torch.set_num_threads(threads)
