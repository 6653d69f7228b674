#!/usr/bin/env bash
# Packages the GPU check needs that the lent GPU machine lacks (it has torch, lightning, accelerate, tokenizers,
# safetensors, pyarrow, pandas and triton, but an older transformers and no datasets, hydra, DeepSpeed or Liger, and it
# has no network). Run this here, once: it downloads them for that machine's Python 3.12 into `.whl/` (git-ignored,
# about 20 MB), which a device run carries (`carry: [".whl"]`); benchmarks/gpu_check.sh installs them first.
#
#   bash benchmarks/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
exclude="$(git rev-parse --git-path info/exclude)"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
mkdir -p .whl
platform=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# the versions CI tests with (pure-Python wheels, and pydantic-core built for that Python)
wheels=(transformers==5.24.0 datasets==5.2.0 hydra-core==1.3.8 omegaconf==2.3.1 dill==0.4.1 multiprocess==0.70.19
        pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 hjson==3.1.0
        liger-kernel==0.8.5)
sdists=(antlr4-python3-runtime==4.9.3 deepspeed==0.19.8)  # source only; pure Python to build (DeepSpeed JIT-builds its ops)
python3 -m pip download -q --no-deps "${platform[@]}" -d .whl "${wheels[@]}"
python3 -m pip download -q --no-deps --no-binary=:all: -d .whl "${sdists[@]}"
du -sh .whl
