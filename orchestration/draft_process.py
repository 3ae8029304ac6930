"""A draft replica without Ray: the service's DraftServer behind its internal gRPC stream, in a process of its own.

The data plane of the decoupled service (trees, outcomes and buffer updates over the speculation stream) is the same
with or without Ray Serve; Serve adds the public proxy, placement and restarts. `evospec bench decoupled --transport
local` measures that data plane with this process, and so does scripts/gpu_check.sh on a GPU machine whose image has
no Ray (Ray's wheel is larger than what a device run can carry).

    with local_draft_replica(draft_cfg) as address:   # "127.0.0.1:<port>"; the process stops on exit
        ...

The child reads its config (JSON) from argv and the stream's shared secret from $EVOSPEC_INTERNAL_SECRET (not argv:
other users can read a process' arguments), prints "port <n>" once it serves, and serves until its stdin closes, so
it never outlives the process that started it.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

from evospec.services.config import DraftServiceConfig

SECRET_ENV = "EVOSPEC_INTERNAL_SECRET"  # the same variable orchestration/app.py reads
START_TIMEOUT_S = 300.0  # loading a model and the first CUDA context can take minutes on a cold machine


@contextlib.contextmanager
def local_draft_replica(cfg: DraftServiceConfig, start_timeout_s: float = START_TIMEOUT_S) -> Iterator[str]:
    """Start a draft replica process for `cfg` (with `cfg.internal.secret`, if any, as the stream's secret; the
    target's DraftLinkConfig must carry the same). Yields its address; stops it on exit."""
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    if cfg.internal.secret:
        env[SECRET_ENV] = cfg.internal.secret
    config_json = cfg.model_dump_json(exclude={"internal": {"secret"}})
    child = subprocess.Popen([sys.executable, "-m", "evospec.orchestration.draft_process", config_json],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env)
    stderr_tail: list[str] = []
    drain = threading.Thread(target=_keep_tail, args=(child.stderr, stderr_tail), daemon=True)
    drain.start()
    try:
        port = _wait_for_port(child, start_timeout_s, stderr_tail)
        yield f"127.0.0.1:{port}"
    finally:
        _stop(child)


def _keep_tail(stream, tail: list[str], keep: int = 40) -> None:
    for line in stream:
        tail.append(line)
        del tail[:-keep]


def _wait_for_port(child: subprocess.Popen, timeout_s: float, stderr_tail: list[str]) -> int:
    """The port the child printed; RuntimeError with its last log lines if it exits or stays silent too long."""
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(child.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if line and line[0].startswith("port "):
        return int(line[0].split()[1])
    _stop(child)
    why = f"exited with code {child.returncode}" if line else f"printed no port within {timeout_s:.0f} s"
    raise RuntimeError(f"draft replica process {why}:\n" + "".join(stderr_tail[-20:]))


def _stop(child: subprocess.Popen) -> None:
    """Close its stdin (it stops its server and exits), then make sure it is gone."""
    with contextlib.suppress(OSError, ValueError):
        child.stdin.close()
    try:
        child.wait(timeout=30)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def serve_until_stdin_closes(config_json: str) -> None:
    """The child: build the DraftServer of `config_json`, serve its stream on a loopback port, print the port."""
    from evospec.services.draft.server import DraftServer
    from evospec.services.draft.servicer import start_draft_server
    cfg = DraftServiceConfig.model_validate_json(config_json)
    if os.environ.get(SECRET_ENV):
        cfg = cfg.model_copy(update={"internal": cfg.internal.model_copy(update={"secret": os.environ[SECRET_ENV]})})
    server = DraftServer.from_config(cfg)
    stream, port = start_draft_server(server, "127.0.0.1", cfg.internal)
    print(f"port {port}", flush=True)
    try:
        sys.stdin.read()
    finally:
        stream.stop(grace=None)
        server.shutdown()


if __name__ == "__main__":
    try:
        serve_until_stdin_closes(sys.argv[1])
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group; the parent stops too
        pass
