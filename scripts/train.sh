#!/usr/bin/env bash
# Quick start, command 1: set everything up, then train on 2 local MPI ranks.
# Extra arguments go to the training script, e.g. bash scripts/train.sh --epochs 20
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
exec shardwise run -np "${NP:-2}" -- python examples/torch_digits.py "$@"
