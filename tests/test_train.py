"""End-to-end runs of train.py in subprocesses, as a user runs it: sft -> distill -> adaspec, exports and errors, and
what each stage prints (`<stage>.console.txt` beside each run folder)."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers import TINY, check_ok, run_train, stage_overrides
from tests.wandb_files import read_offline_run

pytestmark = pytest.mark.slow


STEPS = {"sft": 4, "distill": 2, "adaspec": 2, "acceptance_head": 3}


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """Every stage as a separate job, each on the exports of the earlier ones: sft -> distill -> adaspec -> rollout ->
    acceptance_head -> evaluate (logging to W&B, offline). Each training stage gets `trainer.max_steps` from the
    command line. Each job's stdout and stderr are kept in `<stage>.console.txt`."""
    root = tmp_path_factory.mktemp("chain")
    runs = {
        name: root / name for name in ["sft", "distill", "adaspec", "rollout", "acceptance_head", "evaluate"]
    }

    def ran(proc):
        name = next(arg.partition("=")[2] for arg in proc.args if str(arg).startswith("stage="))
        (root / f"{name}.console.txt").write_text(proc.stdout + proc.stderr)
        check_ok(proc)

    ran(run_train(
        ["stage=sft", *TINY, *stage_overrides("sft", STEPS["sft"]), "sft.eval_examples=2", "sft.eval_max_new_tokens=4",
         "scheduler@sft.scheduler=cosine", "sft.scheduler.warmup_fraction=0.25", "trainer.log_every_n_steps=1",
         f"hydra.run.dir={runs['sft']}"]
    ))  # fmt: skip
    target = f"models.target.pretrained_model_name_or_path={runs['sft'] / 'export'}"
    ran(run_train(
        ["stage=distill", *TINY, target, *stage_overrides("distill", STEPS["distill"]), f"hydra.run.dir={runs['distill']}"]
    ))  # fmt: skip
    ran(run_train(
        ["stage=adaspec", *TINY, target, *stage_overrides("adaspec", STEPS["adaspec"]),
         f"adaspec.reference={runs['distill'] / 'export'}", "adaspec.cached_scores=true",
         f"hydra.run.dir={runs['adaspec']}"]
    ))  # fmt: skip
    draft = runs["adaspec"] / "export"
    ran(run_train(
        ["stage=rollout", *TINY, target, f"+rollout.drafts.adaspec={draft}", "rollout.num_prompts=8",
         "rollout.max_new_tokens=8", "rollout.batch_size=4", "rollout.shard_size=4", f"hydra.run.dir={runs['rollout']}"]
    ))  # fmt: skip
    ran(run_train(
        ["stage=acceptance_head", *TINY, f"+acceptance_head.drafts.adaspec={draft}",
         f"+acceptance_head.rollouts.adaspec={runs['rollout'] / 'rollouts' / 'adaspec'}",
         *stage_overrides("acceptance_head", STEPS["acceptance_head"]), f"hydra.run.dir={runs['acceptance_head']}"]
    ))  # fmt: skip
    ran(run_train(
        ["stage=evaluate", *TINY, target, f"+evaluate.drafts.adaspec={draft}",
         f"+evaluate.heads.adaspec={runs['acceptance_head'] / 'adaspec' / 'export'}", "evaluate.num_prompts=2",
         "evaluate.selection_prompts=2", "evaluate.max_new_tokens=6", "evaluate.fixed_lengths=[2]",
         "evaluate.acceptance_head.thresholds=[0.5]", "evaluate.acceptance_head.min_draft_length=1", "logger=wandb",
         "evaluate.prompt_lookup.hybrid=true",
         f"hydra.run.dir={runs['evaluate']}"]
    ))  # fmt: skip
    return runs


@pytest.mark.parametrize("stage", sorted(STEPS))
def test_command_line_max_steps_reaches_every_training_stage(chain, stage):
    """`trainer.max_steps=N` on the command line wins over the stage's own `trainer:` block (the tiny tuning sets
    600 / 300 steps), so each run stopped after exactly N optimizer steps."""
    run_dir = chain[stage] / "adaspec" if stage == "acceptance_head" else chain[stage]
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == STEPS[stage]


def test_evaluate_reports_every_policy_and_the_acceptance_head_ratios(chain):
    result = json.loads((chain["evaluate"] / "result.json").read_text())
    assert (
        "adaspec/acceptance_head_over_best_fixed_k" in result
        and "adaspec/acceptance_head_over_oracle" in result
    )
    names = [e["name"] for e in json.loads((chain["evaluate"] / "report.json").read_text())["entries"]]
    assert any("acceptance_head_h0.5" in n for n in names) and any(n.endswith("fixed_k2") for n in names)
    assert (chain["evaluate"] / "report.txt").is_file()
    # prompt lookup, the training-free baseline, and the draft behind it follow the draft's rows, one row each at
    # their K, and lookup's vLLM settings are written
    assert names[-2:] == ["prompt_lookup/fixed_k2", "adaspec+prompt_lookup/fixed_k2"]
    # the hybrid drafts from the head as the head alone would: at the K chosen for it
    selection = json.loads((chain["evaluate"] / "report.json").read_text())["settings"]["selection"]
    assert selection["adaspec+prompt_lookup"]["draft_k"] == selection["adaspec"]["best_k"]
    # greedy: the offline estimate of every drafter at the K grid, beside the decoded figure (equal but for ties)
    offline = json.loads((chain["evaluate"] / "report.json").read_text())["settings"][
        "offline_tokens_per_target_call"
    ]
    assert set(offline) == {"adaspec", "prompt_lookup", "adaspec+prompt_lookup"}
    assert all(set(by_k) == {"2"} and by_k["2"] >= 1.0 for by_k in offline.values()), offline
    assert result["adaspec/offline_over_decoded_k2"] == pytest.approx(1.0, abs=0.05)
    # and the target's verification cost of 1 .. K + 1 tokens, relative to one token
    cost = json.loads((chain["evaluate"] / "report.json").read_text())["settings"]["verification_cost"]
    assert list(cost) == ["1", "2", "3"] and cost["1"] == 1.0 and all(c > 0 for c in cost.values())
    vllm = json.loads((chain["evaluate"] / "prompt_lookup_speculative_config.json").read_text())
    assert vllm == {
        "method": "ngram",
        "num_speculative_tokens": 2,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    }


def test_evaluate_offline_only_decodes_the_target_alone_and_estimates_every_draft(chain, tmp_path):
    """`evaluate.offline_only=true` (a data-size study's cheap points): one decoded row, the target's, and every
    drafter's offline tokens per target call at each K, the same figure the full evaluate run estimated at K = 2."""
    run_dir = tmp_path / "offline"
    check_ok(run_train(
        ["stage=evaluate", *TINY, f"models.target.pretrained_model_name_or_path={chain['sft'] / 'export'}",
         f"+evaluate.drafts.adaspec={chain['adaspec'] / 'export'}", "evaluate.num_prompts=2",
         "evaluate.selection_prompts=2", "evaluate.max_new_tokens=6", "evaluate.fixed_lengths=[1,2]",
         "evaluate.prompt_lookup.hybrid=true", "evaluate.offline_only=true", f"hydra.run.dir={run_dir}"]
    ))  # fmt: skip
    report = json.loads((run_dir / "report.json").read_text())
    assert [e["name"] for e in report["entries"]] == ["autoregressive"]
    offline = report["settings"]["offline_tokens_per_target_call"]
    assert set(offline) == {"adaspec", "prompt_lookup", "adaspec+prompt_lookup"}
    assert all(set(by_k) == {"1", "2"} for by_k in offline.values()), offline
    full = json.loads((chain["evaluate"] / "report.json").read_text())["settings"][
        "offline_tokens_per_target_call"
    ]
    assert offline["adaspec"]["2"] == pytest.approx(full["adaspec"]["2"])
    assert not (run_dir / "prompt_lookup_speculative_config.json").exists()  # no K was chosen for lookup


# -- the console ----------------------------------------------------------------------------------------------------

STAGES = ["sft", "distill", "adaspec", "rollout", "acceptance_head", "evaluate"]
# messages that once crowded the console; none helps a user (docs: specdistill/utils/console.py)
NOISE = (
    "litlogger",  # Lightning's advertisement
    "Loading weights",  # transformers' per-model bars
    "LeafSpec",  # a torch deprecation notice Lightning triggers
    "to estimate number of stepping batches",
    "Setting accelerator to CPU",  # DeepSpeed on a machine without CUDA
    "anonymous setting",  # W&B, for an argument Lightning passes
    "Saving the dataset",  # a `datasets` bar per saved shard
)


def console(chain, stage: str) -> str:
    text = (chain[stage].parent / f"{stage}.console.txt").read_text()
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)  # terminal colours, if the bars add any


def said_lines(text: str) -> list[str]:
    """Console lines without their log-time prefix; progress-bar states (tqdm's, Rich's) and blank lines left out."""
    lines = [re.sub(r"^\[[\d-]+ [\d:,]+\]", "", line).strip() for line in re.split(r"[\r\n]", text)]
    return [line for line in lines if line and "%|" not in line and "━" not in line]


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_says_each_thing_once_and_nothing_noisy(chain, stage):
    text = console(chain, stage)
    assert [word for word in NOISE if word in text] == []
    repeated = [line for line, count in Counter(said_lines(text)).items() if count > 1]
    assert repeated == []


@pytest.mark.parametrize(
    ("stage", "rows"),
    [
        ("sft", [r"val/loss\s+\d+\.\d{4}", r"export\s+{dir}/export", r"target_accuracy\s+\d\.\d{4}"]),
        ("distill", [r"val/kl_before\s+\d+\.\d{4}", r"val/kl\s+\d+\.\d{4}", r"export\s+{dir}/export"]),
        ("acceptance_head", [r"heads/adaspec\s+{dir}/adaspec/export", r"adaspec/val/ece\s+\d\.\d{4}"]),
        (
            "evaluate",
            [r"report\s+{dir}/report.json", r"adaspec/acceptance_head_over_best_fixed_k\s+\d+\.\d{4}"],
        ),
    ],
)
def test_a_stage_ends_with_its_metrics_and_outputs(chain, stage, rows):
    lines = said_lines(console(chain, stage))
    end = lines.index(f"{stage} finished: {chain[stage]}")
    block = lines[end + 1 :]
    for row in rows:
        pattern = row.replace("{dir}", re.escape(str(chain[stage])))
        assert any(re.fullmatch(pattern, line) for line in block), (row, block)


def test_the_training_bar_ends_at_the_steps_the_run_does(chain):
    """sft: 4 steps of one micro-batch in an epoch of 6 (48 examples / 8); Lightning's own bar said 4/6."""
    bars = [line for line in re.split(r"[\r\n]", console(chain, "sft")) if line.startswith("Epoch")]
    assert bars and bars[-1].startswith("Epoch 0/0 ") and f" {STEPS['sft']}/{STEPS['sft']} " in bars[-1], bars


def test_the_evaluation_run_summary_holds_the_evaluation_metrics(chain):
    """The W&B run of `evaluate` (offline): its summary names the fastest speculative row of the report (prompt lookup's
    included: on the embedded pair it can beat the drafts), sorts a runs table by speedup, no empty table is logged, and
    its name is short and holds no path."""
    run = read_offline_run(next((chain["evaluate"] / "wandb").glob("offline-run-*")))
    summary = run["summary"]
    entries = json.loads((chain["evaluate"] / "report.json").read_text())["entries"]
    fastest = max((e for e in entries if e["draft"] is not None), key=lambda e: e["metrics"]["speedup"])
    assert (
        summary["best/name"] == fastest["name"] and summary["best/speedup"] == fastest["metrics"]["speedup"]
    )
    for key in ("adaspec/fixed_k2/speedup", "adaspec/fixed_k2/acceptance_rate", "adaspec/fixed_k2/tokens_per_target_call",
                "autoregressive/tokens_per_second", "adaspec/acceptance_head_over_best_fixed_k"):  # fmt: skip
        assert isinstance(summary[key], float), key
    logged = {key for row in run["history"] for key in row}
    assert "report/entries/_type" in logged and "report/_type" not in logged
    name = run["run"]["name"]
    assert name.startswith("evaluate ") and len(name) <= 64 and "/" not in name, name


@pytest.mark.parametrize("stage", ["sft", "distill", "adaspec"])
def test_stage_writes_a_loadable_hugging_face_export(chain, stage):
    export = chain[stage] / "export"
    assert (export / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(export)
    tokenizer = AutoTokenizer.from_pretrained(export)
    ids = tokenizer("Tom has 3 apples.", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_sft_follows_its_own_schedule_and_logs_it(chain):
    """`sft.scheduler` (cosine, 1 warmup step of 4) drives the target's learning rate, and every step's rate is
    logged."""
    import csv

    from omegaconf import OmegaConf

    from specdistill.utils.schedules import cosine

    lr = OmegaConf.load(chain["sft"] / ".hydra" / "config.yaml").sft.optimizer.lr
    with (chain["sft"] / "csv" / "metrics.csv").open() as f:
        logged = [float(row["lr-AdamW/decay"]) for row in csv.DictReader(f) if row.get("lr-AdamW/decay")]
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    schedule = cosine(optimizer, total_steps=4, warmup_fraction=0.25)
    expected = []
    for _ in range(4):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert logged == pytest.approx(expected)
    assert len(set(expected)) == 3  # a constant schedule would fail this


def test_distill_reports_validation_before_and_after(chain):
    result = json.loads((chain["distill"] / "result.json").read_text())
    for name in ("val/kl", "val/expected_acceptance", "val/kl_before", "val/expected_acceptance_before"):
        assert name in result
    assert 0.0 <= result["val/expected_acceptance"] <= 1.0


def test_checkpoints_hold_only_trainable_weights(chain):
    ckpt = torch.load(chain["distill"] / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    keys = list(ckpt["state_dict"])
    assert keys and all(k.startswith("draft.") for k in keys), keys[:5]
    assert ckpt["optimizer_states"]


def test_adaspec_caches_reference_scores_and_writes_selection_report(chain):
    out = chain["adaspec"]
    assert (out / "reference_scores" / "specdistill_scores.json").is_file()
    assert (out / "selection_tokens.json").is_file()
    assert (out / "gap_histogram.png").is_file()
    assert json.loads((out / "result.json").read_text())["k"] == pytest.approx(0.4)


def test_relaunch_resumes_instead_of_starting_over(chain):
    """A second launch into a finished run directory resumes from last.ckpt and adds no optimizer steps."""
    proc = run_train(
        ["stage=distill", *TINY, f"models.target.pretrained_model_name_or_path={chain['sft'] / 'export'}",
         *stage_overrides("distill", STEPS["distill"]), f"hydra.run.dir={chain['distill']}"]
    )  # fmt: skip
    check_ok(proc)
    assert "resuming from" in proc.stdout + proc.stderr


def test_mismatched_tokenizer_is_refused(chain, tmp_path):
    proc = run_train(
        ["stage=distill", *TINY, "models.tokenizer.vocab_size=300",
         f"models.target.pretrained_model_name_or_path={chain['sft'] / 'export'}", f"hydra.run.dir={tmp_path}"]
    )  # fmt: skip
    assert proc.returncode != 0
    assert "does not match" in proc.stderr


def test_adaspec_without_reference_says_how_to_fix(tmp_path):
    proc = run_train(["stage=adaspec", *TINY, f"hydra.run.dir={tmp_path}"])
    assert proc.returncode != 0
    assert "adaspec.reference" in proc.stderr


def test_missing_data_file_is_a_clear_error(tmp_path):
    proc = run_train(
        [
            "stage=sft",
            "task=gsm8k",
            f"task.data_files={tmp_path / 'missing.jsonl'}",
            *TINY[3:],
            f"hydra.run.dir={tmp_path}",
        ]
    )
    assert proc.returncode != 0
    assert "missing.jsonl" in proc.stderr


def test_unknown_task_lists_the_options(tmp_path):
    proc = run_train(["task=not_a_task", f"hydra.run.dir={tmp_path}"])
    assert proc.returncode != 0
    assert "gsm8k" in proc.stderr  # Hydra lists the available task options


def test_evaluate_fits_the_hybrids_choice_of_matches_on_the_selection_split(chain, tmp_path):
    """`evaluate.prompt_lookup.choice=fitted`: the hybrid's kept match lengths are fitted on validation answers after
    its K is chosen, recorded with its choices, and the offline estimate follows them (it equals the decoded figure
    as the fixed rule's does)."""
    run_dir = tmp_path / "fitted"
    check_ok(run_train(
        ["stage=evaluate", *TINY, f"models.target.pretrained_model_name_or_path={chain['sft'] / 'export'}",
         f"+evaluate.drafts.adaspec={chain['adaspec'] / 'export'}", "evaluate.num_prompts=2",
         "evaluate.selection_prompts=2", "evaluate.max_new_tokens=6", "evaluate.fixed_lengths=[2]",
         "evaluate.prompt_lookup.hybrid=true", "evaluate.prompt_lookup.choice=fitted",
         "evaluate.prompt_lookup.choice_sequences=8", "evaluate.policies={}", f"hydra.run.dir={run_dir}"]
    ))  # fmt: skip
    report = json.loads((run_dir / "report.json").read_text())
    chosen = report["settings"]["selection"]["adaspec+prompt_lookup"]["lookup_lengths"]
    assert set(chosen) <= {1, 2, 3}
    assert f"lookup at matched lengths {chosen}" in (run_dir / "report.txt").read_text()
    result = json.loads((run_dir / "result.json").read_text())
    assert result["adaspec+prompt_lookup/offline_over_decoded_k2"] == pytest.approx(1.0, abs=0.05)
    bad = run_train(
        ["stage=evaluate", *TINY, "evaluate.prompt_lookup.choice=best", f"hydra.run.dir={tmp_path / 'bad'}"]
    )
    assert bad.returncode != 0
    assert (
        "evaluate.prompt_lookup.choice='best' must be match (every match) or fitted"
        in bad.stdout + bad.stderr
    )
