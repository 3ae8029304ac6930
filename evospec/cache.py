"""Where the project keeps what it builds or downloads once (expanded tiny pair, fetched real pairs)."""
from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "EVOSPEC_CACHE"


def cache_dir() -> Path:
    """`$EVOSPEC_CACHE`, else ~/.cache/evospec."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "evospec")
