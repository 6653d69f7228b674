#!/usr/bin/env bash
# A separate Python environment with vLLM's `speculators` package, at .venv-speculators/ or $1, for the test that
# loads our EAGLE-3 export with speculators' own API (tests/test_eagle3_speculators.py; it finds the environment
# there or at $SPECDISTILL_SPECULATORS_PYTHON). speculators 0.9.0 pins transformers<=5.19 (we run a newer one), so it
# gets its own environment, as tests/vllm_cpu_env.sh does for vLLM. A second run finds the environment and returns.
set -euo pipefail
cd "$(dirname "$0")/.."
ENV_DIR="${1:-.venv-speculators}"
check='import speculators, transformers; from speculators.models.eagle3 import Eagle3DraftModel
assert transformers.__version__ == "5.19.0", transformers.__version__'
if [[ -x "$ENV_DIR/bin/python" ]] && "$ENV_DIR/bin/python" -c "$check" 2>/dev/null; then
    exit 0
fi
python -m venv "$ENV_DIR"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first: a CPU build on local disk (seconds); left to speculators' requirements, pip fetches a multi-GB CUDA one
"$ENV_DIR/bin/python" -m pip install -q torch==2.13.0
# speculators requires torchvision and torchaudio (it imports neither): versions that accept torch 2.13.0, so that pip
# keeps the CPU torch (torchvision 0.28.0 pins torch==2.13.0; torchaudio 2.11.1, the newest here, asks torch>=2.11)
"$ENV_DIR/bin/python" -m pip install -q speculators==0.9.0 transformers==5.19.0 torch==2.13.0 torchvision==0.28.0 \
    torchaudio==2.11.1
# PyPI's torchvision and torchaudio are built for CUDA torch: with the CPU torch their extensions fail to load
# ("operator torchvision::nms does not exist", "Could not load ... _torchaudio.so"), which breaks transformers'
# imports. speculators' EAGLE-3 model needs neither: drop them when they do not import.
"$ENV_DIR/bin/python" -c "import torchvision, torchaudio" 2>/dev/null ||
    "$ENV_DIR/bin/python" -m pip uninstall -q -y torchvision torchaudio
"$ENV_DIR/bin/python" -c "$check
from importlib.metadata import version
print('speculators_env.sh: speculators', version('speculators'), 'transformers', transformers.__version__, 'in $ENV_DIR')"
