#!/usr/bin/env bash
# The project's one test command: set up, lint, type-check, unit tests, end-to-end tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
VENV=${KVGATE_VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PWD/.tools/bin:$PATH"
echo "== ruff"
ruff check .
ruff format --check .
echo "== mypy"
scripts/typecheck.sh
# CI also builds what a user deploys and what the cluster tests run against (elsewhere: `make
# images && make images-test`, and `make cluster` once). Cold on 2 cores: the images ~10 min and
# their smoke tests ~1.5 min (the engine image would have crashed at start, and nothing noticed),
# the control plane's and Envoy Gateway's Go builds ~15 min; both are cached on the machine after.
if [[ ${CI:-} == true ]]; then
    echo "== images (scripts/images.sh) and their smoke tests"
    scripts/images.sh
    pytest tests/images -m images -p no:cacheprovider
    echo "== control plane (scripts/build_cluster.sh)"
    scripts/build_cluster.sh >/dev/null
fi
echo "== pytest"
set +e
# Two workers: most of the run waits on processes (engines, Envoy, the control plane), so two
# finish it in far less time than one, even on two cores; conftest.py keeps each file on one
# worker and the tests that bind fixed addresses on the same one. --durations: every run (CI's
# too) names its slowest tests. KVGATE_TEST_WORKERS=0 runs everything in this one process.
pytest tests e2e -n "${KVGATE_TEST_WORKERS:-2}" --dist loadgroup --durations=25 "$@"
rc=$?
set -e
# 5 = no tests collected: an empty suite is not a failure.
if [[ $rc -eq 5 ]]; then rc=0; fi
exit $rc
