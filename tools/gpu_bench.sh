#!/usr/bin/env bash
# The one-call GPU benchmark: bench/gpu_train.py (a ~1B Llama-style bf16 model, every ZeRO row, Slipstream and
# DeepSpeed 0.19.8 on the same card) on a machine with a GPU and torch's CUDA build but no network. Results
# (gpu_train.json, gpu_train.md, the log) go to $OUT (or ./gpu-bench-out); BUDGET seconds (default 450) bound
# all rows together. Extra arguments go to bench/gpu_train.py.
#
#   bash tools/gpu_bench.sh --prepare     # here, with network: fills .gpu-wheels/ (base: Slipstream's pure
#                                          # requirements; peer: a DeepSpeed 0.19.8 wheel built without ops and
#                                          # its requirements), binary wheels for CPython 3.10-3.13 on x86_64
#   bash tools/gpu_bench.sh [ARGS]        # on the GPU machine (carry .gpu-wheels): installs, then measures
#   bash tools/gpu_bench.sh --dry-run     # anywhere: the whole path on the CPU with a tiny model
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.gpu-wheels}
PY=${PYTHON:-python3}
PEER_REQS="einops hjson msgpack ninja packaging psutil py-cpuinfo pydantic pydantic-core annotated-types
  typing-extensions typing-inspection tqdm"

prepare() {
  mkdir -p "$WHEELS/base" "$WHEELS/peer"
  "$PY" -m pip download -q --no-deps --no-binary :all: deepspeed==0.19.8 -d "$WHEELS/src" || return 1
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELS/peer" \
    "$WHEELS"/src/deepspeed-0.19.8.tar.gz || return 1
  for version in 3.10 3.11 3.12 3.13; do
    "$PY" -m pip download -q --only-binary :all: --platform manylinux2014_x86_64 --python-version "$version" \
      --implementation cp -d "$WHEELS/base" "pydantic>=2.5" "hjson>=3.0" || return 1
    # shellcheck disable=SC2086
    "$PY" -m pip download -q --only-binary :all: --platform manylinux2014_x86_64 --python-version "$version" \
      --implementation cp --no-deps -d "$WHEELS/peer" $PEER_REQS || return 1
  done
  rm -rf "$WHEELS/src"
  du -sh "$WHEELS"
}

install() {  # Slipstream's requirements into /tmp/site, DeepSpeed and its own into /tmp/ds-site (never mixed)
  if ls "$WHEELS"/base/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-compile --no-cache-dir --target /tmp/site \
      --find-links "$WHEELS/base" pydantic hjson || return 1
    export PYTHONPATH=/tmp/site:$PWD
  else
    export PYTHONPATH=$PWD
  fi
  PEER_PATH=""
  if ls "$WHEELS"/peer/deepspeed-*.whl >/dev/null 2>&1; then
    # shellcheck disable=SC2086
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/ds-site \
      --find-links "$WHEELS/peer" deepspeed $PEER_REQS || return 1
    PEER_PATH=/tmp/ds-site
    export PATH="$PATH:/tmp/ds-site/bin"  # the ninja its JIT builds call (a machine's own ninja comes first)
  fi
}

if [ "${1:-}" = "--prepare" ]; then
  prepare
  exit $?
fi
OUT=${OUT:-gpu-bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
case " $* " in
  *" --dry-run "*)  # the CPU: this checkout's environment, the peer venv if there is one
    [ -x .venv/bin/python ] && PY=.venv/bin/python
    exec "$PY" bench/gpu_train.py --out "$OUT" --budget "${BUDGET:-450}" "$@" ;;
esac
install || { echo "gpu_bench: installing the carried wheels from $WHEELS failed" >&2; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())" \
  | tee -a "$OUT/gpu.txt"
PEER_ARGS=(--peer-python "$PY" --peer-path "$PEER_PATH")
[ -z "$PEER_PATH" ] && PEER_ARGS=(--peer-python "$PWD/no-deepspeed-wheel-carried")
"$PY" bench/gpu_train.py --out "$OUT" --budget "${BUDGET:-450}" "${PEER_ARGS[@]}" "$@" 2>&1 | tee "$OUT/gpu_train.log"
exit "${PIPESTATUS[0]}"
