"""`task=local`: your own JSONL/CSV/Parquet files with any field names, a prompt template and a chosen metric."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from specdistill.export.hf import export_pretrained
from specdistill.models.loading import load_model
from specdistill.stages import evaluate
from specdistill.tasks.base import TaskDataError
from specdistill.tasks.local import LocalTask
from tests.helpers import ROOT, TINY, check_ok, run_train, stage_overrides

FIXTURES = ROOT / "tests" / "fixtures" / "local"
FILES = f"{{train:{FIXTURES / 'qa_train.jsonl'},test:{FIXTURES / 'qa_test.jsonl'}}}"
QA = [
    "task.fields.prompt=q",
    "task.fields.answer=a",
    "task.prompt_template='Q: {prompt}\\nA: '",
    "task.metric=number",
]
MODELS = [o for o in TINY if o.startswith("models.")]


def compose_local(*overrides: str) -> LocalTask:
    with initialize_config_dir(config_dir=str(ROOT / "conf" / "task"), version_base="1.3"):
        return instantiate(compose(config_name="local", overrides=[f"data_files={FILES}", *overrides]))


def test_fields_templates_and_splits_from_the_files():
    task = compose_local(
        "fields.prompt=q", "fields.answer=a", "prompt_template='Q: {prompt} ({source})\\nA: '"
    )
    train = task.load_split("train")
    assert len(train) == 32 and len(task.load_split("test")) == 6
    record = train[0]
    assert task.prompt(record) == f"Q: {record['q']} (generated)\nA: "
    assert task.answer(record) == record["a"]
    assert task.required_columns == ("q", "a", "source")


@pytest.mark.parametrize(
    ("metric", "generated", "expected"),
    [
        ("number", " 27\nWhat is 1 plus 1?", 1.0),
        ("number", "It is 26.", 0.0),
        ("exact_match", "  27  \nmore", 1.0),
        ("exact_match", "27 apples", 0.0),
        ("rougeL", "27", 1.0),
    ],
)
def test_each_metric_scores_the_generation(metric, generated, expected):
    task = compose_local("fields.prompt=q", "fields.answer=a", f"metric={metric}")
    assert task.score(generated, {"q": "What is 13 plus 14?", "a": "27"}) == expected
    assert task.metric_name == {"number": "accuracy"}.get(metric, metric)


def test_bad_settings_name_the_key_and_the_fix(tmp_path: Path):
    with pytest.raises(ValueError, match="task.data_files"):
        LocalTask(fields={"prompt": "q", "answer": "a"})
    with pytest.raises(InstantiationException, match="task.metric='bleu'"):
        compose_local("fields.prompt=q", "fields.answer=a", "metric=bleu")
    with pytest.raises(InstantiationException, match="task.fields"):
        compose_local("+fields.context=c")
    wrong = compose_local()  # default fields prompt/answer: the files have q/a
    with pytest.raises(TaskDataError, match="lacks columns"):
        wrong.load_split("train")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"q": "What is 1 plus 1?", "a": "two"}) + "\n")
    with pytest.raises(TaskDataError, match="holds no number"):
        LocalTask(data_files=str(bad), fields={"prompt": "q", "answer": "a"}, metric="number").load_split(
            "train"
        )


@pytest.mark.slow
def test_local_task_through_sft_and_evaluate(tmp_path: Path):
    task = ["task=local", f"task.data_files={FILES}", "++task.holdout.validation=4", *QA]
    sft = tmp_path / "sft"
    done = run_train(["stage=sft", *task, *MODELS, *stage_overrides("sft", 2), "sft.eval_examples=2",
                      "sft.eval_max_new_tokens=4", f"hydra.run.dir={sft}"])  # fmt: skip
    check_ok(done)
    console = (done.stdout + done.stderr).splitlines()
    # one line per event: Lightning's lines once (not also through its own handler), no advertisement
    assert sum("GPU available" in line for line in console) == 1
    assert not any("litlogger" in line.lower() for line in console)
    result = json.loads((sft / "result.json").read_text())
    assert result["stage"] == "sft" and (sft / "export" / "model.safetensors").is_file()
    evaluate = tmp_path / "evaluate"
    check_ok(run_train(["stage=evaluate", *task, *MODELS, f"models.target.pretrained_model_name_or_path={sft / 'export'}",
                        f"+evaluate.drafts.own={sft / 'export'}", "evaluate.num_prompts=2", "evaluate.selection_prompts=2",
                        "evaluate.max_new_tokens=4", "evaluate.fixed_lengths=[2]", "evaluate.policies={}",
                        f"hydra.run.dir={evaluate}"]))  # fmt: skip
    report = json.loads((evaluate / "report.json").read_text())
    assert report["entries"] and all(e["task_metric"] is not None for e in report["entries"])


def test_evaluate_reports_another_tasks_prompts_and_chooses_k_on_the_runs_task(tmp_path: Path):
    """`evaluate.test_task`: the reported prompts come from that task's split (here the local QA files' test split),
    while K is chosen on the run's task (arith's validation split), as when a code draft is trained on one corpus and
    evaluated on HumanEval."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["stage=evaluate", *TINY, "+task@evaluate.test_task=local",
                                          f"evaluate.test_task.data_files={FILES}",
                                          *(f"evaluate.test_task.{o.removeprefix('task.')}" for o in QA),
                                          "evaluate.test_task.metric=exact_match",  # arith's is accuracy
                                          "evaluate.num_prompts=3", "evaluate.selection_prompts=2",
                                          "evaluate.max_new_tokens=4", "evaluate.fixed_lengths=[1,2]",
                                          "evaluate.policies={}", "evaluate.warmup=0"])  # fmt: skip
    tokenizer = instantiate(cfg.models.tokenizer)
    draft = export_pretrained(
        load_model(instantiate(cfg.models.draft), len(tokenizer)), tokenizer, tmp_path / "d"
    )
    cfg.evaluate.drafts = {"d": str(draft)}
    out = tmp_path / "evaluate"
    out.mkdir()
    evaluate.run(cfg, out)
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["task"] == "local" and report["settings"]["selection_task"] == "arith"
    assert report["settings"]["selection"]["split"] == "validation"
    outputs = [json.loads(line) for line in (out / "outputs.jsonl").open()]
    assert sorted({r["example_id"] for r in outputs}) == [0, 1, 2]
    # every reported generation was scored with the local task's metric (exact match on its answers)
    assert report["settings"]["task_metric_name"] == "exact_match"
    assert all(e["task_metric"] is not None for e in report["entries"])
