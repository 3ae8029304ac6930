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
    errors = threading.Thread(target=_keep_tail, args=(child.stderr, stderr_tail), daemon=True)
    errors.start()
    port: list[int] = []
    answered = threading.Event()  # set once the child printed its port, or its stdout ended (it exited)
    threading.Thread(target=_read_port, args=(child.stdout, port, answered), daemon=True).start()
    try:
        answered.wait(start_timeout_s)
        if not port:
            exited = answered.is_set()
            child.terminate()  # still loading (or gone): it would not read its stdin yet
            _stop(child)
            errors.join(timeout=5)
            why = (f"exited with code {child.returncode}" if exited
                   else f"printed no port within {start_timeout_s:g} s")
            raise RuntimeError(f"draft replica process {why}:\n" + "".join(stderr_tail[-20:]))
        yield f"127.0.0.1:{port[0]}"
    finally:
        _stop(child)


def _keep_tail(stream, tail: list[str], keep: int = 40) -> None:
    for line in stream:
        tail.append(line)
        del tail[:-keep]


def _read_port(stream, port: list[int], answered: threading.Event) -> None:
    """The first line "port <n>" gives the port; every other line is read and dropped (a full pipe would block
    the child)."""
    for line in stream:
        if not port and line.startswith("port "):
            port.append(int(line.split()[1]))
            answered.set()
    answered.set()


def _stop(child: subprocess.Popen, grace_s: float = 5.0) -> None:
    """Close its stdin (a serving child stops its server and exits), then terminate it if it is still there (one
    still loading its model), and kill it as a last resort."""
    with contextlib.suppress(OSError, ValueError):
        child.stdin.close()
    for end in (lambda: None, child.terminate, child.kill):
        end()
        try:
            child.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


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
