#!/usr/bin/env bash
# Create .bench-venv: a separate virtual environment holding DeepSpeed, used only as a benchmark peer by
# bench/cpu_adam.py (Slipstream never imports deepspeed). torch is pinned and installed first as a CPU build, so
# that pip never pulls a CUDA build; DS_BUILD_OPS=0 makes DeepSpeed JIT-compile its cpu_adam at first use.
# Usage: bash bench/make_peer_venv.sh   (env: PYTHON=python3.11, BENCH_VENV=.bench-venv, TORCH_VERSION=2.13.0)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV="${BENCH_VENV:-.bench-venv}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install --upgrade pip wheel setuptools
# A local +cpu wheel (pip find-links) or a configured CPU index is used first; otherwise the PyTorch CPU index.
"$VENV/bin/pip" install "torch==${TORCH_VERSION}+cpu" \
    || "$VENV/bin/pip" install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
# Re-pinning the installed torch keeps pip from swapping it for a CUDA build while resolving deepspeed.
TORCH_PIN="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null | tail -n 1)"
# safetensors and huggingface_hub: DeepSpeed's zero_to_fp32.py --safe_serialization (bench/checkpoint.py).
# transformers, accelerate: the Trainer peer of bench/trainer.py. tabulate: DeepSpeed's autotuner (bench/autotune.py).
DS_BUILD_OPS=0 "$VENV/bin/pip" install ninja py-cpuinfo numpy deepspeed safetensors huggingface_hub transformers accelerate tabulate \
    "torch==${TORCH_PIN}"
"$VENV/bin/python" -c "import torch, deepspeed; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__)"
