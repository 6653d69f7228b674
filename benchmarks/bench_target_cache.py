"""AdaSPEC from cached target distributions and cached reference scores vs online, on the embedded pair.

1. The embedded pair (`conf/models/tiny.yaml`: GPT-NeoX target 6x256, draft 1x128, arith BPE tokenizer) is built
   by the stages' own builders; the target is fine-tuned for `--sft-steps` on the arith train split (as the adaspec
   pipeline's sft step does) so that its distributions are peaked like a real target's.
2. Offline passes (timed, once): `build_target_cache` (top-m per answer token, train and validation) and
   `cached_reference_scores` (D(p, r) per answer token).
3. Two AdaSPEC drafts from the same initialisation train `--epochs` epochs on the same batches
   (`DistillModule.training_step` + backward + AdamW step, k = 0.4): online (target and reference run every step)
   and cached (`CachedTarget` + `CachedReferenceScores`, no target or reference model). The script prints the epoch
   time of each and their ratio (goal >= 3x), the cache's divergence error against the exact divergence, and
   `val/expected_acceptance` of both drafts measured against the exact target (goal: within 0.5 points).

    python benchmarks/bench_target_cache.py [--train 512] [--epochs 2] [--m 64] [--sft-steps 150]
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from specdistill.data.target_cache import build_target_cache
from specdistill.losses import ForwardKL
from specdistill.losses.answers import answer_mask, answer_token_cross_entropy
from specdistill.losses.chunked import rowwise
from specdistill.losses.divergence import expected_acceptance
from specdistill.losses.rows import answer_rows
from specdistill.modules import DistillModule
from specdistill.selection.reference import CachedReferenceScores, OnlineReference, cached_reference_scores
from specdistill.selection.selectors import AdaSpecSelector
from specdistill.stages.datamodules import build_datamodule
from specdistill.stages.model_loading import load_models, model_spec

ROOT = Path(__file__).resolve().parents[1]


def with_window(batch: dict) -> dict:
    return {**batch, "window_answer_tokens": answer_mask(batch["labels"]).sum()}


def sft(model: torch.nn.Module, batches: list[dict], steps: int) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        batch = batches[step % len(batches)]
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = answer_token_cross_entropy(logits, batch["labels"]) / answer_mask(batch["labels"]).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval().requires_grad_(False)


def train_epochs(module: DistillModule, batches: list[dict], epochs: int) -> float:
    """Seconds per epoch of training steps (forward, backward, optimizer step)."""
    optimizer = module.configure_optimizers()
    module.log = lambda *args, **kwargs: None  # no Trainer: nothing to log to
    start = time.perf_counter()
    for _ in range(epochs):
        for batch in batches:
            loss = module.training_step(batch, 0)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return (time.perf_counter() - start) / epochs


@torch.no_grad()
def exact_acceptance(target, draft, batches: list[dict], vocab: int) -> float:
    """Mean expected acceptance per validation answer token against the exact target (what val/... logs online)."""
    total, count = 0.0, 0
    for batch in batches:
        keep = answer_mask(batch["labels"])
        (values,) = rowwise(
            [expected_acceptance],
            answer_rows(target, batch, keep, vocab),
            answer_rows(draft, batch, keep, vocab),
        )
        total, count = total + float(values.sum()), count + values.numel()
    return total / count


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--train", type=int, default=512, help="arith train problems")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--m", type=int, default=64)
    parser.add_argument("--sft-steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    overrides = ["stage=adaspec", f"task.sizes.train={args.train}", "task.sizes.validation=64"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    specs = {name: model_spec(cfg.models[name]) for name in ("target", "draft")}
    tokenizer, models, vocab = load_models(cfg, {**specs, "reference": specs["draft"]})
    target, draft = models["target"], models["draft"]
    reference = models["reference"]
    datamodule = build_datamodule(
        cfg, tokenizer, 256, batch_size=args.batch_size, eval_batch_size=args.batch_size
    )
    train = [with_window(b) for b in datamodule.scoring_dataloader("train")]
    val = list(datamodule.val_dataloader())
    sft(target, train, args.sft_steps)
    sft(reference, train, args.sft_steps // 3)  # a reference a little closer to the target than the draft
    divergence = ForwardKL()

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        cache = build_target_cache(Path(tmp) / "target", target, tokenizer, datamodule, vocab, m=args.m)
        cache_seconds = time.perf_counter() - start
        start = time.perf_counter()
        scores = cached_reference_scores(Path(tmp) / "ref", target, reference, datamodule, divergence, vocab)
        score_seconds = time.perf_counter() - start
        datamodule.attach_column("train", "ref_divergence", scores)
        cached_train = [with_window(b) for b in datamodule.scoring_dataloader("train")]

        # divergence error of the cache on the validation split, for the untrained draft
        exact, sparse = [], []
        with torch.no_grad():
            for batch in val:
                keep = answer_mask(batch["labels"])
                draft_rows = answer_rows(draft, batch, keep, vocab)
                exact.append(divergence.rows(answer_rows(target, batch, keep, vocab), draft_rows))
                sparse.append(divergence.rows(cache.rows(batch, keep, "validation"), draft_rows))
        exact, sparse = torch.cat(exact), torch.cat(sparse)
        tail = torch.cat([cache.rows(b, answer_mask(b["labels"]), "validation").tail_mass for b in val])

        def module(target_or_cache, reference_provider) -> DistillModule:
            student = load_models(cfg, {"draft": specs["draft"]})[1][
                "draft"
            ]  # the same initialisation each time
            student.train().requires_grad_(True)
            return DistillModule(
                student, target_or_cache, vocab, divergence, functools.partial(torch.optim.AdamW, lr=1e-3),
                selector=AdaSpecSelector(k=0.4), reference=reference_provider,
            )  # fmt: skip

        online = module(target, OnlineReference(reference, divergence, vocab))
        cached = module(cache, CachedReferenceScores())
        online_seconds = train_epochs(online, train, args.epochs)
        cached_seconds = train_epochs(cached, cached_train, args.epochs)
        acceptance = {name: exact_acceptance(target, m.draft, val, vocab) for name, m in (("online", online),
                                                                                         ("cached", cached))}  # fmt: skip
        initial = exact_acceptance(target, draft, val, vocab)

    tokens = sum(int(b["window_answer_tokens"]) for b in train)
    print(f"embedded pair, {args.train} train problems ({tokens} answer tokens), batch {args.batch_size}, "
          f"m = {args.m} of V = {vocab}, target fine-tuned {args.sft_steps} steps, {args.threads} thread(s)")  # fmt: skip
    print(
        f"  offline passes (once): target cache {cache_seconds:.1f} s, reference scores {score_seconds:.1f} s"
    )
    print(f"  cache accuracy on validation tokens: mean tail mass {tail.mean():.4f}; forward KL exact "
          f"{exact.mean():.4f}, from cache {sparse.mean():.4f}, mean |error| {(sparse - exact).abs().mean():.2e} "
          f"({(sparse - exact).abs().mean() / exact.mean():.2%} of the mean)")  # fmt: skip
    print(f"  AdaSPEC epoch: online {online_seconds:.1f} s, cached {cached_seconds:.1f} s -> "
          f"{online_seconds / cached_seconds:.2f}x faster (goal >= 3x)")  # fmt: skip
    print(f"  val expected acceptance (exact target) after {args.epochs} epochs: initial {initial:.4f}, "
          f"online {acceptance['online']:.4f}, cached {acceptance['cached']:.4f} -> "
          f"{100 * (acceptance['cached'] - acceptance['online']):+.2f} points (goal within 0.5)")  # fmt: skip


if __name__ == "__main__":
    main()
