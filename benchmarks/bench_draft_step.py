"""One drafting step of an EAGLE-3 head against one of a standalone (cut-layer) draft and one of the target, and one
block of a DFlash drafter against K head steps, in one process: what a drafted token costs relative to a target
token.

    python benchmarks/bench_draft_step.py                        # the real pair: experiment=smollm2_eagle3
    python benchmarks/bench_draft_step.py --eagle3 <run>/adaspec/export --standalone <cut run>/adaspec/export \\
        --dflash <dflash run>/distill/export
    python benchmarks/bench_draft_step.py --config models=tiny draft=eagle3 draft.aux_layer_ids=[1,3,4] \\
        --standalone-config models=tiny draft=cut_layers draft.num_layers=1 \\
        --dflash-config models=tiny draft=dflash draft.block_size=4 \\
        [--context 256] [--steps 64] [--repeats 5] [--threads 2] [--accepted N]

The target and the head come from the project's configs as `train.py` composes them (`--config`, default the real
pair's `experiment=smollm2_eagle3`, whose `draft` is the EAGLE-3 head); the standalone draft is the `draft` kind of
another composition (`--standalone-config`, default `experiment=smollm2_stdlib`: the three-layer cut), built from
the same target; the DFlash block drafter is the `draft` kind of a third (`--dflash-config`, default
`experiment=smollm2_stdlib draft=dflash`: the real pair's drafter, `conf/draft/dflash.yaml`), built on the same target
too (the other compositions' `models` are not read).
`--eagle3` / `--standalone` / `--dflash` load trained exports instead of untrained ones (same shapes, same cost).

Each model decodes `--steps` single tokens after a `--context`-token prefix, with its KV cache, greedy (argmax of the
logits, which the engine's sampling needs too): the target and the standalone draft through their Hugging Face
forward, the head through `Eagle3Head.forward` (one new chain position: embedding, attention over the cached
positions, MLP, final norm and the draft-vocabulary output layer). Time per step is the best of `--repeats`
round-robin passes (machine drift hits all alike); printed with each draft's ratio to the target's step.

The DFlash block is timed as a decoding round drafts (`DFlashProposer.propose_block`), at a fixed context: the
drafter's context cache holds the states of the first `C - n` context positions, and each round crops it back to
them, extends it by the `n = --accepted + 1` newly verified positions `C - n .. C - 1` (`extend_cache`: `fc`, norm and
every layer's keys and values of those positions; a round after `a` accepted candidates verifies `a + 1`), runs one
`draft` pass of `block_size` positions (the newest token at position `C` and `block_size - 1` masks) and the target's
output layer on the `block_size - 1` candidate states in one call, greedy (argmax, as the other passes): the whole
block. The pass alone (extend + draft) and one candidate's output row are timed too: the proposer scores each
candidate only when the engine asks for it, so a DFlash round of K candidates costs the pass + K rows, printed
against the head's round of K and against the whole block. `--accepted` defaults to
`block_size - 1` (a fully accepted block: the largest extend). Per block = (pass - the cache's prefill) / `--steps`;
the draft pass with the output layer alone (no extend: the cache holds all `C` positions) is timed too. The block is
printed against K EAGLE-3 head steps (K x the head's step above) for K = 1 .. block_size - 1, the chain that drafts
as many tokens, and against one target step. An EAGLE-3 round also reads the newly verified positions first: its
catch-up (one head forward over the same `n` positions' real states, whose last position drafts the first
candidate) is timed the same way, and a head round of K candidates is printed as catch-up + (K - 1) steps.
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


def head_catch_up(
    head, features: torch.Tensor, context: torch.Tensor, new: int, rounds: int
) -> Callable[[], None]:
    """A pass: the head over the context's first `length - new` positions (`length = C - 1` head positions), then
    `rounds` times: the cache cropped back to them and one head forward over the `new` positions after them on their
    real target states (an EAGLE-3 round's catch-up after a verification), the last one's logits scored (greedy)."""
    length = context.shape[1] - 1
    keep = length - new

    def run() -> None:
        cache = Eagle3Cache()
        head(head.embed(context[:, 1 : keep + 1]), head.fuse(features[:, :keep]), torch.arange(keep), cache)
        for _ in range(rounds):
            cache.crop(keep)
            out = head(
                head.embed(context[:, keep + 1 : length + 1]),
                head.fuse(features[:, keep:length]),
                torch.arange(keep, length),
                cache,
            )
            head.target_ids[out.logits[:, -1:].argmax(-1)]

    return run


def dflash_blocks(
    drafter,
    features: torch.Tensor,
    newest: torch.Tensor,
    new: int,
    rounds: int,
    vocab: int,
    score: bool = True,
) -> Callable[[], None]:
    """A pass: the drafter's context cache over the first `C - new` of the `C` positions of `features` `(1, C, n H_t)`,
    then `rounds` times: the cache cropped back to them and extended by the `new` positions after them (skipped when
    `new` is 0), one block after the `C` positions (`newest` `(1,)` first, then masks) and, with `score`, the target's
    output layer on all its `block_size - 1` candidate states in one call (greedy)."""
    output = drafter.output_head(vocab)
    keep = features.shape[1] - new

    def run() -> None:
        cache = drafter.new_cache()
        drafter.extend_cache(cache, features[:, :keep])
        for _ in range(rounds):
            if new:
                cache.crop(keep)
                drafter.extend_cache(cache, features[:, keep:])
            states = drafter.draft(cache, newest)
            if score:
                output(states[0, 1:]).argmax(-1)

    return run


def output_rows(drafter, state: torch.Tensor, steps: int, vocab: int) -> Callable[[], None]:
    """A pass: `steps` times the target's output layer on one candidate state `(1, H)` (greedy), as
    `DFlashProposer` scores each candidate when the engine asks for it."""
    output = drafter.output_head(vocab)

    def run() -> None:
        for _ in range(steps):
            output(state).argmax(-1)

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
    parser.add_argument("--dflash-config", nargs="*", default=["experiment=smollm2_stdlib", "draft=dflash"])
    parser.add_argument("--eagle3", type=Path, default=None, help="an EAGLE-3 export (default: untrained)")
    parser.add_argument(
        "--standalone", type=Path, default=None, help="a standalone export (default: untrained)"
    )
    parser.add_argument("--dflash", type=Path, default=None, help="a DFlash export (default: untrained)")
    parser.add_argument(
        "--accepted",
        type=int,
        default=None,
        help="candidates accepted in the round before the timed DFlash block (its extend covers accepted + 1 "
        "positions; default block_size - 1)",
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
    dflash_cfg = compose_run(args.dflash_config)
    tokenizer = instantiate(cfg.models.tokenizer)
    vocab = len(tokenizer)
    target = freeze(load_model(instantiate(cfg.models.target))).eval()
    head = load_or_build(cfg.draft, target, vocab, args.eagle3, tokenizer)
    standalone = load_or_build(standalone_cfg.draft, target, vocab, args.standalone, tokenizer)
    dflash = load_or_build(dflash_cfg.draft, target, vocab, args.dflash, tokenizer)
    size = dflash.config.block_size
    accepted = size - 1 if args.accepted is None else args.accepted
    if not 0 <= accepted <= size - 1:
        parser.error(f"--accepted {accepted} must lie in [0, {size - 1}] (block_size {size})")
    new = accepted + 1
    if args.context < new + 2:
        parser.error(f"--context {args.context} must be at least {new + 2} (--accepted {accepted} + 3)")
    context = torch.randint(0, vocab, (1, args.context), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        layers = sorted(set(head.config.aux_layer_ids) | set(dflash.config.target_layer_ids))
        _, states = target_states(
            target, {"input_ids": context, "attention_mask": torch.ones_like(context)}, layers
        )
        features = torch.cat([states[i] for i in head.config.aux_layer_ids], dim=-1)
        dflash_features = torch.cat([states[i] for i in dflash.config.target_layer_ids], dim=-1)
    newest = context[0, -1:]  # the block's first token, at position C (its value does not change the cost)
    blocks = {  # name: (pass of `rounds` rounds, for a given count)
        "dflash": lambda rounds: dflash_blocks(dflash, dflash_features, newest, new, rounds, vocab),
        "dflash_draft": lambda rounds: dflash_blocks(dflash, dflash_features, newest, 0, rounds, vocab),
        "dflash_pass": lambda rounds: dflash_blocks(
            dflash, dflash_features, newest, new, rounds, vocab, False
        ),
        "eagle3_catch_up": lambda rounds: head_catch_up(head, features, context, new, rounds),
    }
    runs = {
        "target": causal_lm_steps(target, context, args.steps),
        "standalone": causal_lm_steps(standalone, context, args.steps),
        "eagle3": head_steps(head, features, context, args.steps),
        **{name: make(args.steps) for name, make in blocks.items()},
        "output_row": output_rows(dflash, torch.zeros(1, dflash.config.hidden_size), args.steps, vocab),
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
        for name, make in blocks.items():
            prefill[name] = min(_timed(make(0)) for _ in range(args.repeats))
    prefill["output_row"] = 0.0
    per_step = {name: (best[name] - prefill[name]) / args.steps for name in runs}
    params = {
        "target": sum(p.numel() for p in target.parameters()),
        "standalone": sum(p.numel() for p in standalone.parameters()),
        "eagle3": sum(p.numel() for p in head.parameters()),
        # the target's embeddings and output layer, which the drafter reads, are not its parameters
        "dflash": sum(p.numel() for p in dflash.parameters()),
    }
    print(
        f"{args.steps} one-token steps after a {args.context}-token context, best of {args.repeats}, "
        f"{args.threads} thread(s); head draft vocabulary {head.config.draft_vocab_size}"
    )
    for name in ("target", "standalone", "eagle3"):
        ratio = per_step[name] / per_step["target"]
        print(
            f"  {name:<11} {per_step[name] * 1e3:7.2f} ms/step  {ratio:6.3f}x the target's  {params[name] / 1e6:7.1f}M params"
        )
    print(f"eagle3 / standalone step: {per_step['eagle3'] / per_step['standalone']:.3f}")
    block, target_step, step = per_step["dflash"], per_step["target"], per_step["eagle3"]
    catch_up = per_step["eagle3_catch_up"]
    print(
        f"DFlash block of {size} positions ({size - 1} candidates, {params['dflash'] / 1e6:.1f}M params, target "
        f"layers {list(dflash.config.target_layer_ids)}), a round after {accepted} accepted: {args.steps} rounds "
        f"at a {args.context}-token context"
    )
    print(
        f"  block       {block * 1e3:7.2f} ms  {block / target_step:6.3f}x the target's step  "
        f"(extend by {new} positions + draft + output layer; {block / (size - 1) * 1e3:.2f} ms per candidate)"
    )
    print(f"    draft + output layer  {per_step['dflash_draft'] * 1e3:7.2f} ms (no extend)")
    print(
        f"  eagle3 catch-up of {new} positions {catch_up * 1e3:7.2f} ms (the head's counterpart of the extend)"
    )
    print(
        f"  pass        {per_step['dflash_pass'] * 1e3:7.2f} ms (extend + draft, no output layer); one candidate's "
        f"output row {per_step['output_row'] * 1e3:.2f} ms"
    )
    print(
        "A round of K candidates: the head's catch-up + K - 1 steps; DFlash's pass + K rows scored one at a time "
        "(DFlashProposer), against its whole block scored in one call"
    )
    print(
        "  K  K head steps   block / K steps   head round   DFlash round   DFlash / head round   DFlash / whole block"
    )
    for k in range(1, size):
        round_ = catch_up + (k - 1) * step
        dflash_round = per_step["dflash_pass"] + k * per_step["output_row"]
        print(
            f"  {k:<2} {k * step * 1e3:9.2f} ms  {block / (k * step):13.3f}    {round_ * 1e3:7.2f} ms  "
            f"{dflash_round * 1e3:9.2f} ms  {dflash_round / round_:16.3f}  {dflash_round / block:20.3f}"
        )
    return 0


def _timed(run: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


if __name__ == "__main__":
    sys.exit(main())
