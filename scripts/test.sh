#!/usr/bin/env bash
# Quick start, command 2: set everything up, then run the whole test suite
# (unit tests and the multi-process tests under mpirun with 2 and 4 ranks).
# Extra arguments go to pytest, e.g. bash scripts/test.sh -k mesh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
set +e
python -m pytest tests -p no:cacheprovider -ra --durations=25 "$@"
rc=$?
set -e
# pytest exits 5 when a -k selection matched nothing: that is not a failure of the code.
if [ "$rc" = 5 ]; then echo "[test] no test selected"; exit 0; fi
exit "$rc"
