"""Environment for every test process (and the Ray workers it starts, which inherit it). The project is installed
(scripts/setup.sh), so tests import it like users do: no sys.path edits."""
import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before any `import ray`: Ray on 127.0.0.1 only
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.pop("RAY_ADDRESS", None)  # never attach to someone else's cluster
