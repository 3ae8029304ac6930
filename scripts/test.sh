#!/usr/bin/env bash
# Set up (idempotent) and run the test suite in one of three tiers (tests/conftest.py):
#   ./scripts/test.sh           CI, the README's command: everything that proves a claim (unit, statistical, fuzz,
#                               end-to-end on a real local Ray Serve, chaos); < 20 min on a 2-core CPU
#   ./scripts/test.sh --fast    unit tests in process, small Hypothesis profile: a developer's loop, < 5 min
#   ./scripts/test.sh --full    nightly/release: CI plus the benchmark tools' own end-to-end runs, with the largest
#                               example and sample counts
# Every run prints the 25 slowest tests. Extra arguments go to pytest (e.g. `-k scheduler`, `-m "not e2e"`).
set -uo pipefail
cd "$(dirname "$0")/.."
tier=ci
case "${1:-}" in
  --fast) tier=fast; shift ;;
  --full) tier=full; shift ;;
  --ci) shift ;;
esac
case "$tier" in
  fast) select=(-m "not e2e and not slow and not chaos and not fuzz and not process and not nightly and not gpu") ;;
  ci) select=(-m "not nightly") ;;
  full) select=() ;;
esac
export EVOSPEC_TEST_TIER=$tier
./scripts/setup.sh || exit 1
before=$(ps -eo pid=,args= | grep -E "raylet|gcs_server|ray::" | grep -v grep | awk '{print $1}' | sort)
start=$(date +%s)
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "${select[@]}" "$@"
rc=$?
cpu=$(.venv/bin/python -c 'from evospec.loading import cpu_description; print(cpu_description())')
echo "tier $tier: $(( $(date +%s) - start )) s on $cpu"
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  rc=1
fi
# The e2e fixture shuts Ray down itself (never `ray stop`); check that nothing of ours is left behind.
for _ in $(seq 1 30); do
  after=$(ps -eo pid=,args= | grep -E "raylet|gcs_server|ray::" | grep -v grep | awk '{print $1}' | sort)
  leftover=$(comm -13 <(echo "$before") <(echo "$after") | grep -v '^$' || true)
  [ -z "$leftover" ] && break
  sleep 1
done
if [ -n "$leftover" ]; then
  echo "processes left behind by the tests:" >&2
  ps -o pid=,args= -p $(echo $leftover | tr ' ' ',') >&2 || true
  [ "$rc" -eq 0 ] && rc=1
fi
exit "$rc"
