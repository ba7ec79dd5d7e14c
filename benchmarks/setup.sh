#!/usr/bin/env bash
# Benchmark set-up: install the optional peers into the project venv (run scripts/setup.sh first).
#   bash benchmarks/setup.sh
# DeepSpeed (ZeRO 1/2/3 rows of benchmarks/zero.py): pure-Python install, no prebuilt ops
# (DS_BUILD_OPS=0). On a CPU-only machine the benchmarks run it with DS_ACCELERATOR=cpu on
# gloo; they set that themselves, and TORCH_EXTENSIONS_DIR for any op it JIT-compiles.
# Horovod (the MPI peer of benchmarks/horovod.py) is built
# by scripts/horovod/build.sh, which scripts/setup.sh already runs.
# accelerate: transformers' own distributed training (DistributedConfig, the peer of
# benchmarks/hf_peer.py) needs it; pure Python, it keeps the venv's torch.
# TorchRec with FBGEMM's CPU kernels (the peer of benchmarks/embeddings.py): torchrec declares the
# CUDA package fbgemm-gpu, which fbgemm-gpu-cpu replaces (the same fbgemm_gpu module), so torchrec
# goes in with --no-deps and its runtime requirements (tensordict, torchmetrics, pyre-extensions,
# tqdm) on their own; scripts/setup.sh already does this, here it is redone only where missing.
# Versions: constraints.txt (deepspeed==, accelerate==), or DS_VERSION / ACCELERATE_VERSION;
# everything else pip touches stays at constraints.txt's versions (torch above all).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${SHARDWISE_VENV:-.venv}/bin/python
[ -x "$PY" ] || { echo "[bench-setup] no venv at $PY: run bash scripts/setup.sh first" >&2; exit 1; }
pinned() { sed -n "s/^$1==\([^ ;#]*\).*/\1/p" constraints.txt; }
# constraints.txt without the two peers, so that DS_VERSION / ACCELERATE_VERSION may differ from it.
others=$(mktemp)
trap 'rm -f "$others"' EXIT
grep -v -E '^(deepspeed|accelerate)==' constraints.txt > "$others"
torch_before=$("$PY" -c "import torch; print(torch.__version__)")
DS_VERSION=${DS_VERSION:-$(pinned deepspeed)}
if "$PY" -c "import deepspeed, sys; sys.exit(deepspeed.__version__ != '$DS_VERSION')" 2>/dev/null; then
    echo "[bench-setup] deepspeed $DS_VERSION already installed"
else
    echo "[bench-setup] installing deepspeed $DS_VERSION (DS_BUILD_OPS=0)"
    # --no-build-isolation: its setup.py imports torch, the venv's CPU build, not a fresh CUDA one.
    DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "$PY" -m pip install --quiet --no-build-isolation -c "$others" \
        "deepspeed==$DS_VERSION" py-cpuinfo ninja
fi
ACCELERATE_VERSION=${ACCELERATE_VERSION:-$(pinned accelerate)}
if "$PY" -c "import accelerate, sys; sys.exit(accelerate.__version__ != '$ACCELERATE_VERSION')" 2>/dev/null; then
    echo "[bench-setup] accelerate $ACCELERATE_VERSION already installed"
else
    echo "[bench-setup] installing accelerate $ACCELERATE_VERSION"
    "$PY" -m pip install --quiet -c "$others" "accelerate==$ACCELERATE_VERSION"
fi
TORCHREC_VERSION=$(pinned torchrec)
FBGEMM_VERSION=$(pinned fbgemm-gpu-cpu)
if [ -z "$TORCHREC_VERSION" ] || [ -z "$FBGEMM_VERSION" ]; then
    echo "[bench-setup] constraints.txt pins no torchrec / fbgemm-gpu-cpu: TorchRec peer not installed" >&2
elif "$PY" - "$TORCHREC_VERSION" "$FBGEMM_VERSION" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(version("torchrec") != sys.argv[1] or version("fbgemm-gpu-cpu") != sys.argv[2])
PY
then
    echo "[bench-setup] torchrec $TORCHREC_VERSION with fbgemm-gpu-cpu $FBGEMM_VERSION already installed"
else
    echo "[bench-setup] installing torchrec $TORCHREC_VERSION with fbgemm-gpu-cpu $FBGEMM_VERSION"
    "$PY" -m pip install --quiet --no-deps -c constraints.txt "torchrec==$TORCHREC_VERSION" \
        "fbgemm-gpu-cpu==$FBGEMM_VERSION"
    "$PY" -m pip install --quiet -c constraints.txt tensordict torchmetrics pyre-extensions tqdm
fi
torch_after=$("$PY" -c "import torch; print(torch.__version__)")
if [ "$torch_before" != "$torch_after" ]; then
    echo "[bench-setup] torch changed from $torch_before to $torch_after: reinstall it with bash scripts/setup.sh" >&2
    exit 1
fi
"$PY" -c "import torchrec, fbgemm_gpu; from torchrec.distributed.model_parallel import DistributedModelParallel" \
    && echo "[bench-setup] torchrec imports (DistributedModelParallel, FBGEMM CPU kernels)"
mkdir -p .venv/torch_extensions
DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$PWD/.venv/torch_extensions "$PY" - <<'PY'
import deepspeed
from deepspeed.accelerator import get_accelerator
print(f"[bench-setup] deepspeed {deepspeed.__version__}, accelerator {get_accelerator().device_name()}, "
      f"communication backend {get_accelerator().communication_backend_name()}")
PY
