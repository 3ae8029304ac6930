"""`evospec adapt status|export|load`: the draft's online adaptation on a running application, through Serve
handles to the Draft deployment (the control plane; the data plane is the internal stream).

With several draft replicas each adapts on the sessions it serves: a handle call reaches one replica (Serve's
routing), so `status` and `export` report that replica and `load` loads into that one. To give every replica the same
adapter, set `draft.adapt.checkpoint` in the application config (restored when a replica starts) and redeploy.

It joins a Ray cluster that other drivers can join (`ray start --head`, then `serve run` / `serve deploy` of the
application). `evospec serve` runs its own private local cluster, which this command cannot reach: there, the
checkpoint is the way to save and restore the adapter. Not exercised against a live cluster in CI.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from evospec.orchestration.config import AppConfig

CALL_TIMEOUT_S = 60.0


def draft_handle(address: str, app_name: str):
    import ray
    from ray import serve
    if not ray.is_initialized():
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    return serve.get_deployment_handle("Draft", app_name=app_name)


def call(handle, method: str, *args):
    return getattr(handle, method).remote(*args).result(timeout_s=CALL_TIMEOUT_S)


def run(args) -> int:
    handle = draft_handle(args.address, args.app)
    if args.adapt_cmd == "status":
        stats = call(handle, "adapt_stats")
        if not stats:
            print("this application's draft does not adapt (draft.adapt.mode: off)")
            return 1
        print(json.dumps(stats, indent=1))
    elif args.adapt_cmd == "export":
        data = call(handle, "export_adapter")
        Path(args.out).write_bytes(data)
        print(f"wrote {args.out} ({len(data) / 1024:.0f} KiB)")
    else:
        version = call(handle, "load_adapter", Path(args.file).read_bytes())
        print(f"loaded {args.file}: the draft serves it as version {version} from its next step")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("adapt", help="online adaptation of a running application's draft: status, export, load")
    asub = p.add_subparsers(dest="adapt_cmd", required=True)
    for name, help_ in (("status", "adapter version, training steps, loss, memory (JSON)"),
                        ("export", "save the draft's current adapter (safetensors)"),
                        ("load", "load an exported adapter into the draft (serves from its next step)")):
        c = asub.add_parser(name, help=help_)
        c.add_argument("--address", default="auto", help="Ray cluster address (default: the running local one)")
        c.add_argument("--app", default=AppConfig().app_name, help="Serve application name")
        if name == "export":
            c.add_argument("--out", required=True, help="file to write (.safetensors)")
        if name == "load":
            c.add_argument("file", help="an exported adapter (.safetensors)")
    p.set_defaults(func=lambda args: _safe_run(args))


def _safe_run(args: argparse.Namespace) -> int:
    try:
        return run(args)
    except Exception as exc:  # noqa: BLE001 - one clear line, not a Ray traceback
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
