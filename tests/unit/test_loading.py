"""evospec/loading.py helpers the replicas start with."""
from __future__ import annotations

import threading

import pytest


def test_start_up_work_runs_in_a_thread_that_ends():
    """Loading runs in a thread that ends (its OpenMP team with it: evospec/loading.py in_passing_thread): the
    result and any exception reach the caller, and no thread of that name is left."""
    from evospec.loading import in_passing_thread
    assert in_passing_thread(lambda: threading.current_thread().name, "probe-load") == "probe-load"
    with pytest.raises(ValueError, match="bad weights"):
        in_passing_thread(lambda: (_ for _ in ()).throw(ValueError("bad weights")), "probe-load")
    assert not [t for t in threading.enumerate() if t.name == "probe-load"]
