"""One drafting step of an EAGLE-3 head against one of a standalone (cut-layer) draft and one of the target, in one
process: what a drafted token costs relative to a target token.

    python benchmarks/bench_draft_step.py                        # the real pair: experiment=smollm2_eagle3
    python benchmarks/bench_draft_step.py --eagle3 <run>/adaspec/export --standalone <cut run>/adaspec/export
    python benchmarks/bench_draft_step.py --config models=tiny draft=eagle3 draft.aux_layer_ids=[1,3,4] \\
        --standalone-config models=tiny draft=cut_layers draft.num_layers=1 [--context 256] [--steps 64] [--repeats 5] [--threads 2]

The target and the head come from the project's configs as `train.py` composes them (`--config`, default the real
pair's `experiment=smollm2_eagle3`, whose `draft` is the EAGLE-3 head); the standalone draft is the `draft` kind of
another composition (`--standalone-config`, default `experiment=smollm2_stdlib`: the three-layer cut), built from
the same target.
`--eagle3` / `--standalone` load trained exports instead of untrained ones (same shapes, same cost).

Each model decodes `--steps` single tokens after a `--context`-token prefix, with its KV cache, greedy (argmax of the
logits, which the engine's sampling needs too): the target and the standalone draft through their Hugging Face
forward, the head through `Eagle3Head.forward` (one new chain position: embedding, attention over the cached
positions, MLP, final norm and the draft-vocabulary output layer). Time per step is the best of `--repeats`
round-robin passes (machine drift hits all three alike); printed with each draft's ratio to the target's step.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import DynamicCache

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from specdistill.drafts.eagle3.model import Eagle3Cache  # noqa: E402


def compose_run(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=overrides)


def causal_lm_steps(model, context: torch.Tensor, steps: int) -> Callable[[], None]:
    """A pass: prefill `context` `(1, C)`, then `steps` one-token greedy forwards with the KV cache."""

    def run() -> None:
        cache = DynamicCache()
        out = model(input_ids=context, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)

    return run


def head_steps(head, features: torch.Tensor, context: torch.Tensor, steps: int) -> Callable[[], None]:
    """A pass: the head over the context's real target states (one forward, as after a verification), then `steps`
    chain positions, each on the previous position's output and the token it drafted."""

    def run() -> None:
        cache = Eagle3Cache()
        length = context.shape[1] - 1
        positions = torch.arange(length)
        out = head(head.embed(context[:, 1:]), head.fuse(features[:, :length]), positions, cache)
        for step in range(steps):
            token = head.target_ids[out.logits[:, -1:].argmax(-1)]
            out = head(head.embed(token), out.hidden[:, -1:], torch.tensor([length + step]), cache)

    return run


def load_or_build(kind_cfg, target, vocab: int, export: Path | None, tokenizer):
    from hydra.utils import instantiate

    from specdistill.drafts import load_draft
    from specdistill.models.loading import freeze

    if export is not None:
        return load_draft(export, vocab_size=vocab, target=target).model.eval()
    return freeze(instantiate(kind_cfg).build(target, vocab)).eval()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", nargs="*", default=["experiment=smollm2_eagle3"])
    parser.add_argument("--standalone-config", nargs="*", default=["experiment=smollm2_stdlib"])
    parser.add_argument("--eagle3", type=Path, default=None, help="an EAGLE-3 export (default: untrained)")
    parser.add_argument(
        "--standalone", type=Path, default=None, help="a standalone export (default: untrained)"
    )
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from hydra.utils import instantiate

    from specdistill.drafts.base import target_states
    from specdistill.models import load_model
    from specdistill.models.loading import freeze

    cfg = compose_run(args.config)
    standalone_cfg = compose_run(args.standalone_config)
    tokenizer = instantiate(cfg.models.tokenizer)
    vocab = len(tokenizer)
    target = freeze(load_model(instantiate(cfg.models.target))).eval()
    head = load_or_build(cfg.draft, target, vocab, args.eagle3, tokenizer)
    standalone = load_or_build(standalone_cfg.draft, target, vocab, args.standalone, tokenizer)
    context = torch.randint(0, vocab, (1, args.context), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        layers = head.config.aux_layer_ids
        _, states = target_states(
            target, {"input_ids": context, "attention_mask": torch.ones_like(context)}, layers
        )
        features = torch.cat([states[i] for i in layers], dim=-1)
    runs = {
        "target": causal_lm_steps(target, context, args.steps),
        "standalone": causal_lm_steps(standalone, context, args.steps),
        "eagle3": head_steps(head, features, context, args.steps),
    }
    best = dict.fromkeys(runs, float("inf"))
    with torch.no_grad():
        for run in runs.values():  # warm-up
            run()
        for _ in range(args.repeats):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - start)
    # the prefill is common to all passes of a model; per step = (pass - prefill) / steps, the prefill timed alone
    prefill = {}
    with torch.no_grad():
        for name, make in (("target", causal_lm_steps), ("standalone", causal_lm_steps)):
            model = target if name == "target" else standalone
            prefill[name] = min(_timed(make(model, context, 0)) for _ in range(args.repeats))
        prefill["eagle3"] = min(_timed(head_steps(head, features, context, 0)) for _ in range(args.repeats))
    per_step = {name: (best[name] - prefill[name]) / args.steps for name in runs}
    params = {
        "target": sum(p.numel() for p in target.parameters()),
        "standalone": sum(p.numel() for p in standalone.parameters()),
        "eagle3": sum(p.numel() for p in head.parameters()),
    }
    print(
        f"{args.steps} one-token steps after a {args.context}-token context, best of {args.repeats}, "
        f"{args.threads} thread(s); head draft vocabulary {head.config.draft_vocab_size}"
    )
    for name in runs:
        ratio = per_step[name] / per_step["target"]
        print(
            f"  {name:<11} {per_step[name] * 1e3:7.2f} ms/step  {ratio:6.3f}x the target's  {params[name] / 1e6:7.1f}M params"
        )
    print(f"eagle3 / standalone step: {per_step['eagle3'] / per_step['standalone']:.3f}")
    return 0


def _timed(run: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


if __name__ == "__main__":
    sys.exit(main())
