"""Typed config -> the Serve application (one builder), plus `app_builder` for `serve run` / `serve deploy`.

    serve run evospec.orchestration.app:app_builder config=cpu-tiny.yaml
"""
from __future__ import annotations

import os
import secrets

from ray.serve import Application

from evospec.orchestration.config import AppConfig
from evospec.services.config import ReplicaConfig
from evospec.services.draft.deployment import DraftDeployment
from evospec.services.target.deployment import TargetDeployment

# Serve's gRPC proxy must register our public service (and standard health) on its server. The first entry registers
# no service: it makes the proxy answer a failed target replica with UNAVAILABLE and no internals, and hand malformed
# requests to our front (INVALID_ARGUMENT); it must precede the services it applies to (services/target/ingress/).
GRPC_SERVICER_FUNCTIONS = [
    "evospec.services.target.ingress.install_error_policy",
    "evospec_client.api.v1.generate_pb2_grpc.add_GenerateServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]


def _deployment_options(cfg: AppConfig, replica: ReplicaConfig) -> dict:
    return dict(num_replicas=replica.num_replicas,
                ray_actor_options={"num_gpus": replica.num_gpus, "num_cpus": replica.num_cpus,
                                   "resources": dict(replica.resources)},
                max_ongoing_requests=cfg.max_ongoing_requests,
                health_check_period_s=replica.health_check_period_s,
                health_check_timeout_s=replica.health_check_timeout_s,
                graceful_shutdown_timeout_s=cfg.graceful_shutdown_timeout_s,
                graceful_shutdown_wait_loop_s=min(2.0, cfg.graceful_shutdown_timeout_s / 2))


INTERNAL_SECRET_ENV = "EVOSPEC_INTERNAL_SECRET"


def internal_secret(cfg: AppConfig) -> str:
    """The secret both deployments share for the speculation stream: the config's, else $EVOSPEC_INTERNAL_SECRET,
    else a fresh random one for this build (every replica of both deployments gets the same init arguments)."""
    secret = cfg.draft.internal.secret or os.environ.get(INTERNAL_SECRET_ENV) or secrets.token_urlsafe(32)
    if len(secret) < 16:
        raise ValueError(f"${INTERNAL_SECRET_ENV} must be at least 16 characters")
    return secret


def build_app(cfg: AppConfig) -> Application:
    """Draft and Target deployments; each gets only its own config (as a JSON-able dict: Serve ships it). Target
    replicas look for as many draft replicas as the draft's config asks for, and authenticate with the draft's
    secret."""
    secret = internal_secret(cfg)
    internal = cfg.draft.internal.model_copy(update={"secret": secret})
    draft_cfg = cfg.draft.model_copy(update={"internal": internal})
    draft = DraftDeployment.options(**_deployment_options(cfg, cfg.draft.replica)).bind(
        draft_cfg.model_dump(mode="json"))
    link = cfg.target.draft_link.model_copy(update={"replicas": cfg.draft.replica.num_replicas, "secret": secret})
    target = cfg.target.model_copy(update={"draft_link": link})
    return TargetDeployment.options(**_deployment_options(cfg, cfg.target.replica)).bind(
        draft, target.model_dump(mode="json"))


def app_builder(args: dict) -> Application:
    """Serve app builder: `config=<yaml>` and/or inline overrides of AppConfig fields."""
    args = dict(args)
    path = args.pop("config", None)
    base = AppConfig.from_yaml(path).model_dump() if path else {}
    return build_app(AppConfig(**{**base, **args}))
