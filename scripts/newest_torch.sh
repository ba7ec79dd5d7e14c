#!/usr/bin/env bash
# Run shardwise's unit tests and three multi-process test files against the newest torch
# the package index offers, in a venv of its own (the project's .venv is not touched).
#   bash scripts/newest_torch.sh                 # newest torch
#   TORCH_SPEC="==2.15.0" bash scripts/newest_torch.sh
# Everything but torch is installed at constraints.txt's versions, so what differs from
# the CI set is torch alone. PyPI offers newer torch releases as their CUDA build only (a
# few GB with the nvidia-* wheels it depends on); it runs on a CPU-only machine all the
# same. Where a pip configuration caps torch (pip config list: global.constraint), lift it
# for this run with PIP_CONSTRAINT=/dev/null.
# Env: NEWEST_TORCH_VENV (default /tmp/shardwise-newest-torch), TORCH_SPEC (default: newest),
#      PYTEST_ARGS (extra pytest arguments), MP_TESTS (space-separated test files instead of
#      the three below; empty: unit tests only).
# The last line printed is the result: torch version, unit and multi-process test counts.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
VENV=${NEWEST_TORCH_VENV:-/tmp/shardwise-newest-torch}
read -r -a MP_TESTS <<< "${MP_TESTS-tests/distributed/test_collectives_mp.py tests/distributed/test_zero_mp.py tests/distributed/test_torch_dp_mp.py}"

say() { echo "[newest-torch] $*"; }

[ -x "$VENV/bin/python" ] || { say "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
py="$VENV/bin/python"
"$py" -m pip install --quiet --upgrade pip 2>&1 | grep -v -i warning || true

say "installing torch${TORCH_SPEC:-} (newest unless TORCH_SPEC is set)"
start=$(date +%s)
"$py" -m pip install --quiet --upgrade "torch${TORCH_SPEC:-}" 2>&1 | grep -v -i warning || true
torch_version=$("$py" -c "import torch; print(torch.__version__)")
say "torch $torch_version installed in $(( $(date +%s) - start )) s"

# The rest at the CI's versions, torch left as it is (it is not among the constraints here).
grep -v -E '^torch==' constraints.txt > "$VENV/constraints-but-torch.txt"
say "installing shardwise with the CI's other packages"
"$py" -m pip install --quiet -c "$VENV/constraints-but-torch.txt" \
    -e ".[torch,tf-cpu,keras,jax,hf,mpi,test]" 2>&1 | grep -v -i warning || true
after=$("$py" -c "import torch; print(torch.__version__)")
[ "$after" = "$torch_version" ] || { say "installing shardwise changed torch $torch_version -> $after" >&2; exit 1; }
# The CUDA build brings Triton, whose LLVM and TensorFlow's abort a process that loads both
# ("LLVM ERROR: inconsistency in registered CommandLine options"; pytorch/pytorch#90166), as
# the unit tests do. Without a GPU Triton has nothing to do (the CPU build ships none): drop it.
if "$py" -c "import importlib.util, sys, torch; sys.exit(not (importlib.util.find_spec('triton') and not torch.cuda.is_available()))"; then
    say "no CUDA device: uninstalling triton (it aborts a process that also imports TensorFlow)"
    "$py" -m pip uninstall --quiet -y triton
fi

export PATH="$VENV/bin:$PATH" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
if [ "$(id -u)" = "0" ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi

summary() {  # pytest's summary line, e.g. "812 passed, 3 skipped in 95.1s"
    local line
    if grep -q '^not run' "$1"; then head -n 1 "$1"; return; fi
    line=$(grep -a -E "(passed|failed|error|skipped|deselected).* in [0-9.]+s" "$1" | tail -n 1 | sed -e 's/^=* *//' -e 's/ *=*$//')
    echo "${line:-no pytest summary: the run was cut short, see $1}"
}
set +e
say "tests/unit"
"$py" -m pytest tests/unit -p no:cacheprovider -q -ra ${PYTEST_ARGS:-} 2>&1 | tee "$VENV/unit.log"
unit_rc=${PIPESTATUS[0]}
if [ "${#MP_TESTS[@]}" -gt 0 ]; then
    say "${MP_TESTS[*]}"
    "$py" -m pytest "${MP_TESTS[@]}" -p no:cacheprovider -q -ra ${PYTEST_ARGS:-} 2>&1 | tee "$VENV/mp.log"
    mp_rc=${PIPESTATUS[0]}
else
    echo "not run (MP_TESTS is empty)" > "$VENV/mp.log"; mp_rc=0
fi
set -e
echo "[newest-torch] torch $torch_version ($(uname -m), $("$py" -c 'import torch; print("CUDA build" if torch.version.cuda else "CPU build")'), cuda available: $("$py" -c 'import torch; print(torch.cuda.is_available())')): unit: $(summary "$VENV/unit.log") (rc $unit_rc); multi-process: $(summary "$VENV/mp.log") (rc $mp_rc)"
[ "$unit_rc" = 0 ] && [ "$mp_rc" = 0 ]
