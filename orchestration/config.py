"""The application config: the two deployments' configs plus Serve-level settings. YAML files in
orchestration/configs/ load into `AppConfig` (every one is validated by tests/unit/test_configs.py)."""
from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from evospec.services.config import DraftServiceConfig, TargetServiceConfig

CONFIG_DIR = Path(__file__).parent / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "cpu-tiny.yaml"  # what tests, benchmarks and `evospec serve` start by default


def resolve_config_path(path: str | Path) -> Path:
    """A path as given, else a file of orchestration/configs/ (so installed packages find their YAMLs by name)."""
    from evospec.loading import given_or_packaged
    resolved = given_or_packaged(path, CONFIG_DIR)
    if not resolved.exists():
        raise FileNotFoundError(f"config {path} not found (nor {CONFIG_DIR / Path(path).name})")
    return resolved


def config_for_pair(pair: str) -> Path:
    """The CPU service config of a pair: orchestration/configs/cpu-<pair>.yaml."""
    path = CONFIG_DIR / f"cpu-{pair}.yaml"
    if not path.exists():
        raise FileNotFoundError(f"no service config for pair {pair!r} ({path})")
    return path


class AppConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    app_name: str = "evospec"
    draft: DraftServiceConfig = DraftServiceConfig()
    target: TargetServiceConfig = TargetServiceConfig()
    max_ongoing_requests: int = Field(128, ge=1)  # per replica; Serve's default 5 collapses streaming throughput
    graceful_shutdown_timeout_s: float = Field(5.0, gt=0)
    grpc_port: int = Field(9000, ge=0, le=65535)  # 0 = any free port (local runner)
    http_port: int = Field(8000, ge=0, le=65535)

    @model_validator(mode="after")
    def _same_static_vocabulary(self) -> "AppConfig":
        if self.draft.static_vocab != self.target.static_vocab:
            raise ValueError(f"draft.static_vocab ({self.draft.static_vocab}) and target.static_vocab "
                             f"({self.target.static_vocab}) must name the same artifact")
        return self

    @classmethod
    def from_yaml(cls, path: str | Path) -> "AppConfig":
        """A YAML path, or the name of a file of orchestration/configs/ (e.g. cpu-qwen2.5-coder.yaml)."""
        return cls(**(yaml.safe_load(resolve_config_path(path).read_text()) or {}))
