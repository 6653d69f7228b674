"""A paper preset shrunk to a few minutes on one GPU, on random weights of the preset's architectures: step time, peak
memory and the achieved fraction of peak FLOP/s per training stage.

Runs the real pipeline (`specdistill.stages.pipeline.run`, the preset's own stage code and Trainer) on the generated
`arith` task with the arith tokenizer (no network), the target and draft built from the pair's architecture
(`ARCHITECTURES`: Pythia-1.4B / Pythia-31M by default) with random weights; each training stage stops after
`--steps` optimizer steps. A callback added to every Trainer times the optimizer steps after `--warmup` of them.

    python benchmarks/gpu_preset_step.py [--experiment adaspec_3epoch] [--pair pythia_31m_to_1.4b] [--steps 20]

FLOPs per token: 6 N for the trained model (forward + backward) plus 2 N for each frozen model run in the step
(target; reference when scored online); attention's own FLOPs are left out, so the fraction is a lower bound.
Peak: dense bf16 FLOP/s of the GPU (`PEAK_BF16`, matched on the device name) or `--peak-tflops`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import open_dict  # noqa: E402

import specdistill.stages.trainer as stage_trainer  # noqa: E402
from specdistill.models.frozen import Frozen  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# dense bf16 tensor-core peak FLOP/s (vendor data sheets, without sparsity)
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}
ARCHITECTURES = {  # the pairs' configs (config.json of each hub checkpoint), for random weights offline
    "pythia_31m_to_1.4b": {
        "target": dict(model_type="gpt_neox", hidden_size=2048, num_hidden_layers=24, num_attention_heads=16,
                       intermediate_size=8192, max_position_embeddings=2048, rotary_pct=0.25, vocab_size=50304),
        "draft": dict(model_type="gpt_neox", hidden_size=256, num_hidden_layers=6, num_attention_heads=8,
                      intermediate_size=1024, max_position_embeddings=2048, rotary_pct=0.25, vocab_size=50304),
    },
    "codegen_350m_to_phi2": {
        "target": dict(model_type="phi", hidden_size=2560, num_hidden_layers=32, num_attention_heads=32,
                       intermediate_size=10240, max_position_embeddings=2048, partial_rotary_factor=0.4,
                       vocab_size=51200),
        "draft": dict(model_type="codegen", n_embd=1024, n_layer=20, n_head=16, n_positions=2048, rotary_dim=32,
                      vocab_size=51200),
    },
}  # fmt: skip


class StepProbe(L.Callback):
    """Times optimizer steps (after `warmup`), counts real tokens, reads peak memory; one record per Trainer."""

    def __init__(self, stage: str, warmup: int, peak_flops: float, records: list[dict]) -> None:
        self.stage, self.warmup, self.peak, self.records = stage, warmup, peak_flops, records
        self.steps: list[tuple[float, int]] = []  # (time at the end of each optimizer step, its real tokens)
        self.pending = 0
        self.last_step = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self.trained = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
        self.frozen = sum(
            sum(p.numel() for p in value.model.parameters())
            for holder in [pl_module, getattr(pl_module, "reference", None)]
            if holder is not None
            for value in vars(holder).values()
            if isinstance(value, Frozen)
        )
        self.last_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.pending += int(batch["attention_mask"].sum()) * trainer.world_size
        if trainer.global_step != self.last_step:  # this micro-batch closed an optimizer step
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.steps.append((time.perf_counter(), self.pending))
            self.pending, self.last_step = 0, trainer.global_step

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if len(self.steps) < self.warmup + 2:
            print(f"{self.stage}: {len(self.steps)} steps, too few to time after {self.warmup} warm-up steps")
            return
        start = self.steps[self.warmup][0]
        timed = self.steps[self.warmup + 1 :]
        seconds, tokens = timed[-1][0] - start, sum(n for _, n in timed)
        achieved = (6 * self.trained + 2 * self.frozen) * tokens / seconds
        self.records.append({
            "stage": self.stage, "timed_steps": len(timed), "step_time_s": seconds / len(timed),
            "tokens_per_step": tokens / len(timed), "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0,
            "trained_params": self.trained, "frozen_params": self.frozen,
            "achieved_tflops": achieved / 1e12, "fraction_of_peak": achieved / self.peak,
        })  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", default="adaspec_3epoch")
    parser.add_argument("--pair", default="pythia_31m_to_1.4b", choices=sorted(ARCHITECTURES))
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per training stage")
    parser.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps per stage")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check the wiring on CPU: shrunken architectures, fp32, no figures",
    )
    args = parser.parse_args()
    if not (torch.cuda.is_available() or args.dry_run):
        sys.exit("gpu_preset_step.py needs a CUDA GPU (or --dry-run on CPU)")
    name = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name()
    if args.dry_run:
        args.peak_tflops = args.peak_tflops or 1.0
    peak = args.peak_tflops * 1e12 if args.peak_tflops else next(
        (v for k, v in PEAK_BF16.items() if k in name), None
    )  # fmt: skip
    if peak is None:
        sys.exit(f"no peak FLOP/s known for {name!r}: pass --peak-tflops")

    overrides = [
        f"experiment={args.experiment}", f"models={args.pair}", "task=arith", "trainer.devices=1",
        f"trainer.max_steps={args.steps}", "+trainer.limit_val_batches=2", "+trainer.enable_progress_bar=false",
        "evaluate.num_prompts=4", "evaluate.selection_prompts=2", "evaluate.max_new_tokens=32",
        "evaluate.fixed_lengths=[4]", "sft.eval_examples=0", "adaspec.cached_scores=false",
    ]  # fmt: skip
    arch = ARCHITECTURES[args.pair]
    if args.dry_run:  # the same model types, a few hundred thousand parameters each
        shrink = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 128,
                  "n_embd": 64, "n_layer": 1, "n_head": 2, "rotary_dim": 16, "vocab_size": 512}  # fmt: skip
        arch = {role: {k: shrink.get(k, v) for k, v in config.items()} for role, config in arch.items()}
        overrides += ["trainer.accelerator=cpu", "trainer.precision=32-true", "evaluate.device=cpu"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    with open_dict(cfg):
        cfg.models.tokenizer = {
            "_target_": "specdistill.data.arith_tokenizer.arith_tokenizer",
            "vocab_size": 512,
        }
        for role in ("target", "draft"):
            cfg.models[role].pretrained_model_name_or_path = None
            cfg.models[role].config = arch[role]
        for stage in ("sft", "distill", "adaspec"):
            if stage in cfg:
                cfg[stage].max_length = args.max_length
        cfg.logger = None

    records: list[dict] = []
    build_trainer = stage_trainer.build_trainer

    def probed(cfg_, stage, out_dir, trainer_cfg, callbacks=None, select_best=None):
        probe = StepProbe(stage, args.warmup, peak, records)
        return build_trainer(cfg_, stage, out_dir, trainer_cfg, [*(callbacks or []), probe], select_best)

    # every stage module imported build_trainer by name: patch each one's reference to add the probe
    from specdistill.stages import acceptance_head, adaspec, distill, pipeline, sft

    for module in (sft, distill, adaspec, acceptance_head):
        module.build_trainer = probed
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu_preset_"))
    print(f"{name}: {args.experiment} on {args.pair} (random weights), {args.steps} steps per stage -> {out}")
    pipeline.run(cfg, out)
    print(f"peak bf16 {peak / 1e12:.0f} TFLOP/s")
    for r in records:
        print(
            f"{r['stage']:>8}: step {r['step_time_s'] * 1e3:8.1f} ms, {r['tokens_per_step']:7.0f} tokens/step, "
            f"peak memory {r['peak_memory_gib']:6.2f} GiB, {r['achieved_tflops']:6.1f} TFLOP/s = "
            f"{100 * r['fraction_of_peak']:5.1f}% of peak (trained {r['trained_params'] / 1e6:.0f}M, "
            f"frozen {r['frozen_params'] / 1e6:.0f}M parameters)"
        )
    (out / "gpu_preset_step.json").write_text(
        json.dumps({"device": name, "args": vars(args), "stages": records})
    )


if __name__ == "__main__":
    main()
