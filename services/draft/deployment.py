"""Draft Ray Serve deployment: a thin shim that builds the draft server and runs its in-replica gRPC stream server.

Control plane (address discovery, model name, session count) goes through Serve handles; the per-step data plane is
the internal bidi gRPC stream (~0.2 ms per message vs 2.5-3.4 ms per handle call on these machines).
"""
from __future__ import annotations

import logging

import ray
from ray import serve

from evospec.services.config import DraftServiceConfig
from evospec.services.draft.server import DraftServer
from evospec.services.draft.servicer import start_draft_server

log = logging.getLogger("ray.serve")


@serve.deployment(name="Draft")
class DraftDeployment:
    def __init__(self, config: dict):
        cfg = DraftServiceConfig(**config)
        self.server = DraftServer.from_config(cfg)
        host = cfg.internal_host or ray.util.get_node_ip_address()
        self.grpc_server, port = start_draft_server(self.server, host)
        self._address = f"{host}:{port}"
        log.info("draft %s serving the speculation stream on %s", self.server.model_name, self._address)

    def address(self) -> str:
        return self._address

    def model(self) -> str:
        return self.server.model_name

    def placement(self) -> dict:
        """The node this replica runs on and the resources it holds (operators, the two-node test)."""
        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "resources": context.get_assigned_resources()}

    def num_sessions(self) -> int:
        return self.server.num_sessions()

    def check_health(self) -> None:
        if self.grpc_server is None:
            raise RuntimeError("draft stream server stopped")

    def __del__(self):
        grpc_server = getattr(self, "grpc_server", None)
        if grpc_server is not None:
            grpc_server.stop(grace=0.5)
