"""Environment for every test process (and the Ray workers it starts, which inherit it), and the test tier's
Hypothesis profile. The project is installed (scripts/setup.sh), so tests import it like users do: no sys.path
edits.

Tiers (`scripts/test.sh [--fast | --full]`, which sets $EVOSPEC_TEST_TIER): `fast` (unit tests in process, small
profiles and sample counts), `ci` (the default: everything that proves a claim) and `full` (nightly/release: the
largest example and sample counts, and the benchmark tools' own end-to-end runs). Property tests take their example
count from the tier's profile, statistical tests their sample count from `evospec.testing.samples`.
"""
import os

from hypothesis import HealthCheck, settings

from evospec.testing import TEST_TIER_ENV

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before any `import ray`: Ray on 127.0.0.1 only
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.pop("RAY_ADDRESS", None)  # never attach to someone else's cluster

# Examples per property test, by tier; no deadline (a 2-core CI machine is slow and noisy), and fixtures shared
# across examples are meant (the stacks are per module, not per example).
EXAMPLES = {"fast": 15, "ci": 50, "full": 200}
for tier, examples in EXAMPLES.items():
    settings.register_profile(tier, max_examples=examples, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get(TEST_TIER_ENV, "ci"))
