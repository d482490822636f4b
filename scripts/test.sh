#!/usr/bin/env bash
# Sets up everything the tests need, then runs them. Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test || exit 1
.venv/bin/python -m pytest "$@"
rc=$?
# pytest's 5 means "no tests ran": that is a failure here, not a pass.
if [[ $rc == 5 ]]; then echo "no tests ran" >&2; exit 1; fi
exit $rc
