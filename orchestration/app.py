"""Typed config -> the Serve application (one builder), plus `app_builder` for `serve run` / `serve deploy`.

    serve run orchestration.app:app_builder config=orchestration/configs/cpu-tiny.yaml
"""
from __future__ import annotations

from ray.serve import Application

from orchestration.config import AppConfig

# Serve's gRPC proxy must register our public service (and standard health) on its server.
GRPC_SERVICER_FUNCTIONS = [
    "evospec.api.evospec.v1.generate_pb2_grpc.add_GenerateServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]


def build_app(cfg: AppConfig) -> Application:
    from services.draft.deployment import DraftDeployment
    from services.target.deployment import TargetDeployment
    config = cfg.model_dump(mode="json")
    shutdown = dict(graceful_shutdown_timeout_s=cfg.graceful_shutdown_timeout_s,
                    graceful_shutdown_wait_loop_s=min(2.0, cfg.graceful_shutdown_timeout_s / 2))
    draft = DraftDeployment.options(
        ray_actor_options={"num_gpus": cfg.draft.num_gpus, "num_cpus": cfg.draft.num_cpus,
                           "resources": cfg.draft.resources},
        max_ongoing_requests=cfg.max_ongoing_requests, **shutdown).bind(config)
    return TargetDeployment.options(
        ray_actor_options={"num_gpus": cfg.target.num_gpus, "num_cpus": cfg.target.num_cpus,
                           "resources": cfg.target.resources},
        max_ongoing_requests=cfg.max_ongoing_requests, **shutdown).bind(draft, config)


def app_builder(args: dict) -> Application:
    """Serve app builder: `config=<yaml>` and/or inline overrides of AppConfig fields."""
    args = dict(args)
    path = args.pop("config", None)
    base = AppConfig.from_yaml(path).model_dump() if path else {}
    return build_app(AppConfig(**{**base, **args}))
