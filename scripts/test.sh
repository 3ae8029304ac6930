#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: unit, statistical and end-to-end (real Ray Serve on CPU).
# Extra arguments go to pytest (e.g. `-m "not e2e"`).
set -uo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh || exit 1
before=$(ps -eo pid=,args= | grep -E "raylet|gcs_server|ray::" | grep -v grep | awk '{print $1}' | sort)
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
rc=$?
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
