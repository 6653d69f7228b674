"""SpecDec++ end to end on a toy pair: rollouts -> acceptance head -> draft-length policies compared.

    python benchmarks/bench_specdecpp.py [--device cpu] [--threads 1] [--quick] [--out-dir DIR]

1. A random GPT-NeoX target and a draft made as a noisy copy of it (`specdistill.decoding.toy`), so the acceptance
   rate sits strictly between 0 and 1 and varies with the context.
2. `run_rollouts` on training prompts (same warping as decoding); on the same rollouts, two `AcceptanceHead`s
   trained with `AcceptanceHeadModule` (weighted BCE, w_rej = 6) from hidden-state caches: the paper's candidate
   head and the proposer head (`specdistill/models/acceptance_head.py`); their validation metrics are printed.
3. Validation prompts choose the fixed K and the threshold h (per head and scoring mode) by `modelled_speedup`; the
   test prompts then report every policy: fixed K, transformers' heuristic schedule, the confidence threshold, the
   candidate head (public one-behind scoring and `score_newest`), the proposer head, and the oracle bound.

Columns: the metrics of docs/METHODS.md section 0 (`acceptance_rate`, `tokens_per_target_call`, `mean_draft_length`, `discard_rate`,
`speedup`) and `modelled_speedup` = generated tokens / (target_forwards + c * draft_forwards) for a draft/target cost
ratio c (`--cost-ratio`, 0.1 by default, roughly a 7B draft for a 70B target). The wall-clock `speedup` means little
here because the toy draft is as large as its target; `modelled_speedup` is the number to read.

With w_rej = 6 the head predicts acceptance well below the label mean (it is trained to over-predict rejection), so
small thresholds stop at `min_draft_length`; on a pair with a low acceptance rate try `--thresholds 0.7 0.8 0.9`.
A run with the defaults (CPU, 1 thread, 42 s) gave, on the test prompts, modelled_speedup 1.76 for the candidate
head (h = 0.7, one-behind scoring), 1.73 for the proposer head (h = 0.3), 1.59 for the candidate head with
`score_newest`, against 1.72 for the best fixed K (3), 1.68 heuristic, 1.56 confidence and 2.28 oracle. Neither head
predicts much on this toy pair (rejection AUROC 0.59 candidate, 0.53 proposer): at T = 1 its acceptance is mostly
sampling noise, and the state after the candidate (candidate head) knows which token was drawn a little better than
q(token) alone does. On the embedded arith pair (greedy) the proposer head separates far better (AUROC 0.93 against
0.77-0.82): measure both on your pair.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
import warnings
from functools import partial
from pathlib import Path

import datasets
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from specdistill.decoding.head_policy import AcceptanceHeadPolicy
from specdistill.decoding.policies import (
    ConfidenceThreshold,
    DraftPolicy,
    FixedLength,
    HeuristicSchedule,
    Oracle,
)
from specdistill.decoding.sampling import SamplingConfig
from specdistill.decoding.stats import DecodingStats
from specdistill.decoding.toy import toy_pair
from specdistill.evaluation.runner import evaluate_policies
from specdistill.head_data import RolloutDataModule, build_hidden_cache
from specdistill.models.acceptance_head import AcceptanceHead
from specdistill.modules.acceptance_head import AcceptanceHeadModule
from specdistill.rollout import run_rollouts
from specdistill.utils.schedules import cosine

EOS = 0
THRESHOLDS = (0.3, 0.5, 0.7)
FIXED_KS = (1, 2, 3, 4, 6, 8)
COLUMNS = ("acceptance_rate", "tokens_per_target_call", "mean_draft_length", "discard_rate", "speedup")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--noise", type=float, default=0.15, help="relative weight noise of the draft copy")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 for greedy decoding")
    parser.add_argument("--train-prompts", type=int, default=256)
    parser.add_argument("--val-prompts", type=int, default=16)
    parser.add_argument("--test-prompts", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--w-rej", type=float, default=6.0)
    parser.add_argument("--mixing-ratio", type=float, default=0.15)
    parser.add_argument("--max-draft-length", type=int, default=12)
    parser.add_argument("--thresholds", type=float, nargs="+", default=list(THRESHOLDS), help="h grid")
    parser.add_argument(
        "--cost-ratio", type=float, default=0.1, help="draft forward cost / target forward cost"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, to check the script runs")
    parser.add_argument("--out-dir", default=None, help="default: a temporary directory")
    args = parser.parse_args(argv)
    if args.quick:
        args.train_prompts, args.val_prompts, args.test_prompts = 32, 4, 4
        args.max_new_tokens, args.epochs = 16, 2
    return args


def random_prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 13, (count,), generator=gen).tolist()
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]  # 0 is EOS


def modelled_speedup(stats: DecodingStats, cost_ratio: float) -> float | None:
    cost = stats.target_forwards + cost_ratio * stats.draft_forwards
    return stats.generated_tokens / cost if cost else None


def make_rollouts(args, target, draft, train_prompts, sampling, out: Path) -> float:
    start = time.perf_counter()
    run_rollouts(target, draft, train_prompts, out / "rollouts", sampling, max_new_tokens=args.max_new_tokens,
                 batch_size=32, shard_size=128, seed=args.seed, vocab_size=args.vocab, eos_token_id=EOS,
                 pad_token_id=EOS)  # fmt: skip
    return time.perf_counter() - start


def train_head(args, draft, sampling, out: Path, head_input: str) -> tuple[AcceptanceHead, dict]:
    import lightning as L

    cache = out / f"cache_{head_input}"
    build_hidden_cache(draft, out / "rollouts", cache, mixing_ratio=args.mixing_ratio, seed=args.seed,
                       batch_size=32, pad_token_id=EOS, dtype="float32", head_input=head_input,
                       sampling=sampling)  # fmt: skip
    torch.manual_seed(args.seed)
    head = AcceptanceHead(draft.config.hidden_size, num_blocks=3, input=head_input)
    module = AcceptanceHeadModule(
        head, None, partial(torch.optim.AdamW, lr=args.lr), partial(cosine, warmup_fraction=0.03),
        w_acc=1.0, w_rej=args.w_rej, cache_hidden_states=True, sampling=sampling,
    )  # fmt: skip
    data = RolloutDataModule(str(out / "rollouts"), batch_size=16, mixing_ratio=args.mixing_ratio, val_fraction=0.1,
                             seed=args.seed, pad_token_id=EOS, hidden_cache_dir=str(cache),
                             head_input=head_input)  # fmt: skip
    accelerator = "gpu" if torch.device(args.device).type == "cuda" else "cpu"
    trainer = L.Trainer(accelerator=accelerator, devices=1, max_epochs=args.epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, default_root_dir=str(out))  # fmt: skip
    untrained = trainer.validate(module, datamodule=data, verbose=False)[0]
    trainer.fit(module, datamodule=data)
    trained = trainer.validate(module, datamodule=data, verbose=False)[0]
    head.save(out / f"head_{head_input}")
    info = {"head_untrained": untrained, "head_trained": trained}
    return head.to(args.device).eval(), info


def evaluate(args, target, draft, policies: dict[str, DraftPolicy], prompts, sampling, split: str) -> dict:
    report = evaluate_policies(
        target, {"draft": draft}, policies, [{"prompt_ids": p, "record": None, "example_id": i}
                                             for i, p in enumerate(prompts)],
        None, None, sampling, args.max_new_tokens, args.seed, eos_token_id=EOS, vocab_size=args.vocab,
        keep_outputs=False, split=split, max_draft_length=args.max_draft_length,
    )  # fmt: skip
    baseline = report.baseline.stats if report.baseline is not None else None
    rows = {}
    for entry in report.entries:
        if entry.policy is None:
            continue
        row = entry.metrics(baseline)
        row["modelled_speedup"] = modelled_speedup(entry.stats, args.cost_ratio)
        rows[entry.policy] = row
    return rows


def head_policies(heads: dict[str, AcceptanceHead], args, thresholds=THRESHOLDS) -> dict[str, DraftPolicy]:
    """`head_h{h}` / `head_newest_h{h}` (candidate head, both scoring modes) and `proposer_h{h}`."""
    policies = {}
    for newest in (False, True):
        for h in thresholds:
            name = f"head{'_newest' if newest else ''}_h{h}"
            policies[name] = AcceptanceHeadPolicy(heads["candidate"], h, 2, score_newest=newest)
    for h in thresholds:
        policies[f"proposer_h{h}"] = AcceptanceHeadPolicy(heads["proposer"], h, 2)
    return policies


def best(rows: dict[str, dict], prefix: str) -> str:
    candidates = {k: v["modelled_speedup"] for k, v in rows.items() if k.startswith(prefix)}
    return max(candidates, key=lambda k: candidates[k] or 0.0)


def print_table(title: str, rows: dict[str, dict]) -> None:
    columns = (*COLUMNS, "modelled_speedup")
    print(f"\n{title}")
    print(f"{'policy':<22}" + "".join(f"{c:>24}" for c in columns))
    for name, row in rows.items():
        cells = "".join(f"{'-' if row.get(c) is None else f'{row[c]:.3f}':>24}" for c in columns)
        print(f"{name:<22}{cells}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    datasets.disable_progress_bars()
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="bench_specdecpp_"))
    target, draft = toy_pair(args.vocab, args.hidden, args.layers, noise=args.noise, seed=args.seed)
    target, draft = target.to(args.device), draft.to(args.device)
    sampling = SamplingConfig(temperature=args.temperature)
    prompts = random_prompts(args.train_prompts + args.val_prompts + args.test_prompts, args.vocab, args.seed)
    train = prompts[: args.train_prompts]
    val = prompts[args.train_prompts : args.train_prompts + args.val_prompts]
    test = prompts[args.train_prompts + args.val_prompts :]

    info = {"rollout_s": make_rollouts(args, target, draft, train, sampling, out)}
    heads = {}
    for head_input in ("candidate", "proposer"):
        heads[head_input], info[head_input] = train_head(args, draft, sampling, out, head_input)
        print(f"{head_input} acceptance head, validation split of the rollouts (untrained -> trained):")
        for key, value in info[head_input]["head_trained"].items():
            print(f"  {key:<22} {info[head_input]['head_untrained'][key]:.4f} -> {value:.4f}")

    # Selection on validation prompts only.
    selection = {f"fixed{k}": FixedLength(k) for k in FIXED_KS} | head_policies(heads, args, args.thresholds)
    val_rows = evaluate(args, target, draft, selection, val, sampling, "validation")
    chosen = {
        "fixed": best(val_rows, "fixed"),
        "head": best(val_rows, "head_h"),
        "head_newest": best(val_rows, "head_newest"),
        "proposer": best(val_rows, "proposer_h"),
    }
    print_table("validation (selection of K and h by modelled_speedup)", val_rows)

    fixed_k = int(chosen["fixed"].removeprefix("fixed"))
    h = float(chosen["head"].split("_h")[-1])
    h_newest = float(chosen["head_newest"].split("_h")[-1])
    h_proposer = float(chosen["proposer"].split("_h")[-1])
    report_policies: dict[str, DraftPolicy] = {
        f"fixed{fixed_k}": FixedLength(fixed_k),
        "heuristic": HeuristicSchedule(initial=5),
        "confidence0.4": ConfidenceThreshold(0.4),
        f"head_h{h}": AcceptanceHeadPolicy(heads["candidate"], h, 2, score_newest=False),
        f"head_newest_h{h_newest}": AcceptanceHeadPolicy(heads["candidate"], h_newest, 2, score_newest=True),
        f"proposer_h{h_proposer}": AcceptanceHeadPolicy(heads["proposer"], h_proposer, 2),
        "oracle": Oracle(),
    }
    test_rows = evaluate(args, target, draft, report_policies, test, sampling, "test")
    print_table(f"test ({len(test)} prompts, c = {args.cost_ratio}; K and h chosen on validation)", test_rows)
    result = {"settings": vars(args), "head": info, "chosen_on_validation": chosen, "validation": val_rows,
              "test": test_rows}  # fmt: skip
    path = out / "bench_specdecpp.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nwritten {path}")
    return result


if __name__ == "__main__":
    main()
