"""The engine's log lines in a replica's Serve log.

Ray Serve writes what the `ray.serve` logger says to each replica's log file (`logs/serve/replica_*.log`) and the
driver's console; the engine and servers log under `evospec.*`, which a Ray worker would otherwise drop (its root
logger has no handler). A deployment calls `log_to_serve` first thing in its constructor, so start-up choices (dtype,
operand orders, the budget's measurement) and scheduling decisions (a draft's catch-up deferred) are where an
operator of a Serve application looks.
"""
from __future__ import annotations

import logging


def log_to_serve(package: str = "evospec", level: int = logging.INFO) -> None:
    """Send `package`'s records at `level` and above through the handlers of Serve's logger (idempotent)."""
    ours, serve_logger = logging.getLogger(package), logging.getLogger("ray.serve")
    ours.setLevel(level)
    for handler in serve_logger.handlers:
        if handler not in ours.handlers:
            ours.addHandler(handler)
    ours.propagate = not serve_logger.handlers  # with Serve's handlers, not twice through the root's
