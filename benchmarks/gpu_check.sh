#!/usr/bin/env bash
# One-GPU check of what CPU CI cannot run: the `gpu`-marked tests (DeepSpeed ZeRO-2/3 end to end, fp32 master weights
# under every GPU preset, EAGLE-3 heads under trainer=gpu and ZeRO-2 on a bf16 target, decoded on CUDA), then a paper
# preset shrunk to a few minutes on random weights of its architectures (benchmarks/gpu_preset_step.py), printing
# per training stage the step time, peak memory and the achieved fraction of the GPU's peak bf16 FLOP/s, then the
# loss modes at a 152k vocabulary (benchmarks/bench_training_modes.py; TRAINING_MODES=0 skips it). Offline: no hub
# download is needed.
#
#   bash benchmarks/gpu_check.sh                     # about 10 minutes on one H100/H200
#   STEPS=10 EXPERIMENT=adaspec_3epoch PAIR=codegen_350m_to_phi2 bash benchmarks/gpu_check.sh
#   DRY_RUN=1 bash benchmarks/gpu_check.sh           # CPU: the gpu tests skip, the preset runs shrunken (wiring only)
#
# On a machine without network (the lent GPU machine), run `bash benchmarks/gpu_wheels.sh` here first and carry
# `.whl`: the packages in it are installed into /tmp/site, ahead of the machine's own.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -d .whl ]] && compgen -G ".whl/*" >/dev/null; then
    echo "== installing the carried packages (.whl) into /tmp/site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --no-build-isolation --upgrade \
        --target /tmp/site .whl/*
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -c "import torch, transformers, lightning; print('torch', torch.__version__, 'transformers', transformers.__version__, 'lightning', lightning.__version__, 'cuda', torch.cuda.is_available())"

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline
OUT=${OUT:-outputs/gpu_check}
EXPERIMENT=${EXPERIMENT:-adaspec_3epoch}
PAIR=${PAIR:-pythia_31m_to_1.4b}
STEPS=${STEPS:-20}
mkdir -p "$OUT"

if [[ -n "${DRY_RUN:-}" ]]; then
    preset_args=(--dry-run --steps 6 --warmup 2 --max-length 96)
else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    preset_args=(--steps "$STEPS")
fi

echo "== gpu-marked tests"
status=0
python3 -m pytest -q -m gpu tests/ 2>&1 | tee "$OUT/gpu_tests.txt" || status=$?

echo "== $EXPERIMENT on $PAIR (random weights), $STEPS steps per training stage"
python3 benchmarks/gpu_preset_step.py --experiment "$EXPERIMENT" --pair "$PAIR" "${preset_args[@]}" \
    --out "$OUT/$EXPERIMENT" 2>&1 | tee "$OUT/preset.txt"
echo "figures: $OUT/$EXPERIMENT/gpu_preset_step.json"

if [[ -z "${DRY_RUN:-}" && "${TRAINING_MODES:-1}" == 1 ]]; then
    echo "== distill and adaspec steps at V = 152064: full logits, chunked rows, cached target (bf16 autocast)"
    python3 benchmarks/bench_training_modes.py --device cuda --bf16 --vocab 152064 --target-hidden 2048 \
        --draft-hidden 512 --batch-size 8 --steps 6 --chunk-size 1024 2>&1 | tee "$OUT/training_modes.txt" || status=$?
fi
exit "$status"  # the preset runs even when a test failed; the script still reports the failure
