"""benchmarks/scaling_study.py: its points compose as train.py runs, and its trend and report read the numbers as
measured (the study itself runs on the real pair: docs/results/scaling.md)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hydra import compose

from tests.helpers import hydra_conf, load_benchmark


@pytest.fixture(scope="module")
def study():
    return load_benchmark("scaling_study")


def test_every_point_composes_with_only_the_data_moving(study, tmp_path):
    args = study.parse_args(
        ["--out", str(tmp_path), "--answers", str(tmp_path / "answers"), "--sizes", "10", "40"]
    )
    assert study.points(args) == [(10, 0), (40, 0), (10, 1), (10, 2)]
    with hydra_conf():
        small, large = (
            compose("train", overrides=["experiment=smollm2_eagle3", *study.head_overrides(args, n, 0)])
            for n in (10, 40)
        )
        offline = compose("train", overrides=["experiment=smollm2_eagle3", *study.evaluate_overrides(args),
                                              *study.drafts_overrides(args, study.points(args)),
                                              "evaluate.offline_only=true"])  # fmt: skip
    assert (small.task.max_examples.train, large.task.max_examples.train) == (10, 40)
    assert small.task.subset_seed == 0 and small.trainer.precision == "bf16-mixed"
    assert small.distill.trainer.max_epochs == small.adaspec.trainer.max_epochs == 2
    assert small.distill.trainer.max_steps == small.adaspec.trainer.max_steps == -1
    # nothing else differs between two sizes
    small.task.max_examples.train = 40
    assert small == large
    assert sorted(offline.evaluate.drafts) == sorted(
        f"n{n}_s{s}{m}" for n, s in study.points(args) for m in ("", "_adaspec")
    )
    assert offline.evaluate.offline_only and offline.evaluate.fixed_lengths == [1, 2, 3, 4, 5, 6]
    assert offline.evaluate.prompt_lookup.hybrid
    bare = study.parse_args(["--out", str(tmp_path), "--no-decode-hybrids"])
    with hydra_conf():
        decode = compose("train", overrides=["experiment=smollm2_eagle3",
                                             *study.evaluate_overrides(bare, bare.decode_hybrids)])  # fmt: skip
    assert not decode.evaluate.prompt_lookup.hybrid and args.decode_hybrids
    with pytest.raises(SystemExit):
        study.parse_args(["--out", str(tmp_path), "--sizes", "40", "10"])


def test_the_trend_is_a_least_squares_line_in_log_data(study):
    a, b = study.fit_trend([100, 1000, 10000], [1.1, 1.3, 1.5])
    assert (a, b) == (pytest.approx(0.7), pytest.approx(0.2))
    assert study.needed((a, b), 2.3) == pytest.approx(10**8)
    assert study.needed((1.2, -0.01), 2.3) is None  # a falling trend never reaches the goal
    assert study.fit_trend([10, 100, 1000], [1.0, 1.5, 1.6]) == (
        pytest.approx(4.1 / 3 - 0.6),
        pytest.approx(0.3),
    )


def test_the_report_reads_the_runs_it_names(study, tmp_path):
    args = study.parse_args(["--out", str(tmp_path), "--answers", str(tmp_path), "--sizes", "10", "100",
                             "--seeds", "0"])  # fmt: skip
    tokens = {10: 600, 100: 6000}
    offline = {"prompt_lookup": {str(k): 1.5 for k in args.lengths}}
    for n, s in study.points(args):
        run = study.point_dir(args, n, s) / "distill"
        run.mkdir(parents=True)
        (run / "result.json").write_text(json.dumps({"train/answer_tokens": tokens[n]}))
        for m in study.METHODS:
            offline[study.draft_name(n, s, m)] = {str(k): 1.0 + math.log10(n) / 10 for k in args.lengths}
    offline["n100_s0+prompt_lookup"] = {str(k): 1.7 + k / 100 for k in args.lengths}  # one head's hybrid
    evaluate = tmp_path / "offline" / "evaluate"
    evaluate.mkdir(parents=True)
    (evaluate / "report.json").write_text(
        json.dumps({"settings": {"offline_tokens_per_target_call": offline}})
    )
    study.report(args)
    written = json.loads((tmp_path / "scaling.json").read_text())
    assert [r["answer_tokens"] for r in written["rows"]] == [600, 600, 6000, 6000]
    assert written["trends"]["distill"][1] == pytest.approx(0.1)  # +0.1 per tenfold data
    assert written["needed_answer_tokens"]["distill"] == pytest.approx(
        600 * 10 ** ((2.3 - 1.1) / 0.1), rel=1e-6
    )
    table = Path(tmp_path / "scaling.md").read_text()
    assert "| 100 | 6000 | 0 | adaspec |" in table
    # the hybrid behind the head that has one, and no row for the heads without
    assert "| 100 | 6000 | 0 | distill + lookup | 1.710 | 1.720 | 1.730 | 1.740 | 1.750 | 1.760 |" in table
    assert table.count("+ lookup |") == 1
    assert written["rows"][2]["hybrid_tokens_per_target_call"]["4"] == pytest.approx(1.74)
    assert (tmp_path / "scaling.png").stat().st_size > 0


@pytest.fixture(scope="module")
def chooser():
    return load_benchmark("choose_on_validation")


def test_a_setting_is_chosen_on_validation_prompts_only(chooser, tmp_path):
    """benchmarks/choose_on_validation.py: one distill run per value, then one offline evaluate run on the task's
    validation split (never the test task), and the value with the most tokens per call at K wins."""
    args = chooser.parse_args(["--out", str(tmp_path), "--values", "3", "7", "--answers", str(tmp_path / "a"),
                               "--", "trainer.precision=bf16-mixed"])  # fmt: skip
    with hydra_conf():
        runs = [compose("train", overrides=["experiment=smollm2_eagle3", *chooser.train_overrides(args, v)])
                for v in args.values]  # fmt: skip
        validation = compose(
            "train", overrides=["experiment=smollm2_eagle3", *chooser.evaluate_overrides(args)]
        )
    assert [r.draft.ttt_steps for r in runs] == [3, 7] and runs[0].trainer.precision == "bf16-mixed"
    assert validation.evaluate.test_task is None and validation.evaluate.split == "validation"
    assert validation.evaluate.offline_only and validation.evaluate.fixed_lengths == [1, 2, 3, 4]
    assert sorted(validation.evaluate.drafts) == ["v_3", "v_7"]
    table = {"v_3": {4: 1.30, 1: 1.2}, "v_7": {4: 1.35, 1: 1.1}}
    assert chooser.choose(["3", "7"], table, 4) == "7" and chooser.choose(["3", "7"], table, 1) == "3"
    with pytest.raises(SystemExit, match="no offline figure at K = 4"):
        chooser.choose(["3", "7"], {"v_3": {4: None}, "v_7": {4: 1.0}}, 4)
    with pytest.raises(SystemExit):
        chooser.parse_args(["--out", str(tmp_path), "--values", "3", "3"])
