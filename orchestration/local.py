"""Start the decoupled service on a private local Ray cluster (demo, `evospec serve`, tests) and tear it down.

Choices: a per-process Ray temp dir (never the shared /tmp/ray session), no dashboard, no log forwarding, a small
object store, loopback addresses (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before `import ray`), logical GPUs when no
CUDA device exists so the production `num_gpus: 1` graph schedules unchanged. Shutdown is `serve.shutdown()` +
`ray.shutdown()`; never `ray stop`, which kills every Ray process on the machine.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator

from evospec.orchestration.config import AppConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_environment() -> None:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.pop("RAY_ADDRESS", None)


# The two-node layout of tests and `evospec chaos`: node resources that config pins each deployment to (each
# replica asks 1 of the node's 64, so several replicas fit on a node).
TWO_NODES = ({"target_node": 64.0}, {"draft_node": 64.0})


@contextlib.contextmanager
def local_ray(num_cpus: int = 4, nodes: tuple[dict[str, float], ...] = ()) -> Iterator[None]:
    """A private Ray cluster on this machine: one node, or one node per entry of `nodes` (its custom resources;
    each node gets num_cpus / len(nodes) CPUs, and the machine's GPUs or else 4 logical ones), to place deployments on
    different nodes."""
    prepare_environment()
    import ray
    import torch
    tmp = tempfile.mkdtemp(prefix="rt-", dir="/tmp")  # short: unix socket paths must stay < 107 bytes
    cluster = None
    if nodes:
        from ray.cluster_utils import Cluster
        previous_tmpdir = os.environ.get("RAY_TMPDIR")
        os.environ["RAY_TMPDIR"] = tmp  # Cluster writes its address file under $RAY_TMPDIR/ray, not the shared /tmp/ray
        os.makedirs(os.path.join(tmp, "ray"), exist_ok=True)
        per_node = dict(num_cpus=max(1, num_cpus // len(nodes)), num_gpus=torch.cuda.device_count() or 4,
                        include_dashboard=False,
                        object_store_memory=128 * 1024**2, temp_dir=tmp)
        cluster = Cluster(initialize_head=True, head_node_args={**per_node, "resources": nodes[0]})
        for resources in nodes[1:]:
            cluster.add_node(**per_node, resources=resources)
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    else:
        gpus = torch.cuda.device_count() or 2  # logical GPUs on a CPU machine
        ray.init(address="local", num_cpus=num_cpus, num_gpus=gpus, include_dashboard=False, log_to_driver=False,
                 object_store_memory=256 * 1024**2, _temp_dir=tmp, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
            if previous_tmpdir is None:
                os.environ.pop("RAY_TMPDIR", None)
            else:
                os.environ["RAY_TMPDIR"] = previous_tmpdir
        shutil.rmtree(tmp, ignore_errors=True)


def placed_on_nodes(cfg: AppConfig, nodes: tuple[dict[str, float], ...] = TWO_NODES) -> AppConfig:
    """`cfg` with Target pinned to the first node (1 unit of its custom resource per replica) and Draft to the
    second."""
    def pinned(service, resources):
        asked = {name: 1.0 for name in resources}
        replica = service.replica.model_copy(update={"resources": {**service.replica.resources, **asked}})
        return service.model_copy(update={"replica": replica})
    return cfg.model_copy(update={"target": pinned(cfg.target, nodes[0]), "draft": pinned(cfg.draft, nodes[1])})


@contextlib.contextmanager
def serve_app(cfg: AppConfig, deploy_timeout_s: float = 300.0) -> Iterator[str]:
    """Deploy on the current Ray cluster; yields the gRPC address. Deletes the app and stops Serve on exit."""
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions
    from ray.serve.schema import LoggingConfig

    from evospec.orchestration.app import GRPC_SERVICER_FUNCTIONS, build_app
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # keep the driver's console for our output
    grpc_port = cfg.grpc_port or free_port()
    serve.start(http_options=HTTPOptions(host="127.0.0.1", port=cfg.http_port or free_port()),
                grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=GRPC_SERVICER_FUNCTIONS))
    try:
        serve.run(build_app(cfg), name=cfg.app_name, blocking=False,
                  logging_config=LoggingConfig(enable_access_log=False, log_level="WARNING"))
        wait_running(cfg.app_name, deploy_timeout_s)
        yield f"127.0.0.1:{grpc_port}"
    finally:
        serve.shutdown()


def wait_running(app_name: str, timeout_s: float) -> None:
    """serve.run would wait forever on an unschedulable replica: poll the status with a deadline instead."""
    from ray import serve
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        app = serve.status().applications.get(app_name)
        if app is not None and app.status == "RUNNING":
            return
        if app is not None and app.status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise RuntimeError(f"application {app_name} {app.status}: {app.message}")
        time.sleep(0.25)
    raise TimeoutError(f"application {app_name} not RUNNING after {timeout_s:.0f}s (unschedulable resources?)")


@contextlib.contextmanager
def local_service(cfg: AppConfig, num_cpus: int = 4) -> Iterator[str]:
    with local_ray(num_cpus), serve_app(cfg) as address:
        yield address


@contextlib.contextmanager
def service_to_drive(address: str | None, config: str) -> Iterator[tuple[str, str]]:
    """(address, app name) for tools that drive a service (fuzz, soak): the running one at `address`, else a local
    one started from `config` on free ports and stopped afterwards."""
    cfg = AppConfig.from_yaml(config)
    if address is not None:
        yield address, cfg.app_name
        return
    with local_service(cfg.model_copy(update={"grpc_port": 0, "http_port": 0})) as local_address:
        yield local_address, cfg.app_name


@contextlib.contextmanager
def http_service_to_drive(base_url: str | None, config: str) -> Iterator[tuple[str, str]]:
    """(HTTP base URL, app name) for tools that drive the OpenAI front: the running service at `base_url`, else a
    local one started from `config` on free ports and stopped afterwards."""
    cfg = AppConfig.from_yaml(config)
    if base_url is not None:
        yield base_url.rstrip("/"), cfg.app_name
        return
    port = free_port()
    with local_service(cfg.model_copy(update={"grpc_port": 0, "http_port": port})):
        yield f"http://127.0.0.1:{port}", cfg.app_name


def replica_processes(app_name: str = "evospec") -> dict[str, list]:
    """The Target and Draft replica processes of `app_name` on this machine, by role ("target", "draft"), found by
    their Ray process titles (psutil.Process objects; read only: never used to signal anything)."""
    import psutil
    found: dict[str, list] = {"target": [], "draft": []}
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info.get("cmdline") or ())
        for role in found:
            if f"ServeReplica:{app_name}:{role.capitalize()}" in line:
                found[role].append(proc)
    return found
