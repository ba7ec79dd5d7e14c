#!/usr/bin/env bash
# Single-rank CUDA check of shardwise's torch paths on one GPU: DP (DistributedOptimizer over a
# group of one), ZeRO stage 1/2/3 (a group of one), the pipeline executor on one rank (p=1:
# GPipe, 1F1B, interleaved 1F1B with 2 local chunks). Each runs a few steps of a small model,
# its losses are compared with plain torch on the same device: PASS/FAIL, median step time
# and peak memory per path. Exit status 1 on any FAIL. Logic: benchmarks/gpu_check.py.
#   bash benchmarks/gpu_check.sh                 # cuda
#   bash benchmarks/gpu_check.sh --device cpu    # the same check on the CPU
# Python: $PYTHON, else the project venv (.venv), else python3 (it needs a CUDA build of torch).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
# One process: shardwise's world of one rank is built by the script itself (no launcher needed),
# once on the torch backend (NCCL), once on the mpi backend (CUDA tensors staged through pinned
# host buffers). Exit status 1 when either run has a FAIL.
rc=0
for backend in torch mpi; do
    "$PY" benchmarks/gpu_check.py --device cuda --backend "$backend" "$@" || rc=1
done
exit "$rc"
