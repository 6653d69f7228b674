"""Rollouts across ranks: the shard assignment, two gloo ranks against one process, and the stage's launch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from specdistill.errors import ConfigError
from specdistill.rollout import load_rollouts
from specdistill.rollout.ranks import Ranks, rank_shards
from specdistill.rollout.storage import SETTINGS_NAME, shard_path
from specdistill.stages import rollout as rollout_stage
from specdistill.validation import check_ranks
from tests.helpers import check_ok, run_gloo_ranks, run_train
from tests.test_local_models import SMALL_TASK, save_pair
from tests.test_rollout import PROMPTS, _run, tiny_lm
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("num_shards", [0, 1, 5, 12])
@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_every_shard_belongs_to_exactly_one_rank(num_shards, world_size):
    shares = [rank_shards(num_shards, rank, world_size) for rank in range(world_size)]
    assert sorted(s for share in shares for s in share) == list(range(num_shards))
    assert all(s % world_size == rank for rank, share in enumerate(shares) for s in share)


@pytest.mark.parametrize("rank, world_size", [(2, 2), (-1, 2), (0, 0)])
def test_a_rank_outside_the_world_is_refused(rank, world_size):
    with pytest.raises(ValueError, match="rank must lie in"):
        rank_shards(3, rank, world_size)
    with pytest.raises(ValueError, match="rank must lie in"):
        Ranks(rank, world_size)


# --- two gloo ranks against one process -------------------------------------------------------------------------

_WORKER = """
import json
import torch, torch.distributed as dist
from helpers import join_gloo
from specdistill.rollout.ranks import launch_ranks
from tests.test_rollout import _run, tiny_lm
rank, (root,), out = join_gloo()
torch.set_num_threads(1)  # as the test process: the same reductions, so the same labels to the bit
device, ranks = launch_ranks(torch.device("cpu"), 1, 1, 1.0)  # joins the running group (as in a pipeline)
assert (device.type, ranks.rank, ranks.world_size) == ("cpu", rank, 2), (device, ranks)
pair = (tiny_lm(0, hidden=32), tiny_lm(1, hidden=16))
written, datasets = {}, {}
for name, models, reuse in [("fresh", pair, None), ("resumed", pair, None), ("reused", pair[:1] * 2, "fresh")]:
    written[name] = []
    dataset = _run(models, f"{root}/{name}", on_shard_done=written[name].append, ranks=ranks,
                   responses_from=None if reuse is None else f"{root}/{reuse}")
    datasets[name] = dataset.to_dict()
dist.destroy_process_group()
json.dump({"written": written, "datasets": datasets}, open(out, "w"))
"""


@pytest.mark.slow  # two fresh Python processes importing torch: seconds, more on a loaded machine
def test_two_ranks_write_their_own_shards_of_the_single_process_rollouts(tmp_path):
    """Two gloo ranks split the 3 shards (rank 0: 0 and 2, rank 1: 1) and both load exactly the dataset one process
    makes with the same seed (responses, draft tokens, labels); they resume a directory another world size started,
    and label another draft on reused responses exactly as one process does."""
    pair = (tiny_lm(0, hidden=32), tiny_lm(1, hidden=16))
    single = {"fresh": _run(pair, tmp_path / "single"), "reused": None}
    single["reused"] = _run(pair[:1] * 2, tmp_path / "single_reused", responses_from=tmp_path / "single")
    # "resumed": one process finished shard 2 and died writing shard 0 (its temporary directory is left over)
    shared = tmp_path / "shared"
    (shared / "resumed" / "shards").mkdir(parents=True)
    shutil.copy(tmp_path / "single" / SETTINGS_NAME, shared / "resumed" / SETTINGS_NAME)
    shutil.copytree(shard_path(tmp_path / "single", 2), shard_path(shared / "resumed", 2))
    (shared / "resumed" / "shards" / ".tmp_shard_00000").mkdir()

    results = run_gloo_ranks(_WORKER, str(shared), out_dir=tmp_path)

    assert [r["written"]["fresh"] for r in results] == [[0, 2], [1]]
    assert [r["written"]["resumed"] for r in results] == [[0], [1]]  # shard 2 was kept, not redone
    assert [r["written"]["reused"] for r in results] == [[0, 2], [1]]
    expected = {"fresh": single["fresh"].to_dict(), "resumed": single["fresh"].to_dict()}
    expected["reused"] = single["reused"].to_dict()
    for result in results:
        for name, dataset in result["datasets"].items():
            assert dataset == expected[name], name  # every column, labels to the bit
    assert result["datasets"]["fresh"]["prompt_ids"] == PROMPTS
    for name in expected:  # one set of shards on disk, no leftovers
        assert sorted(p.name for p in (shared / name / "shards").iterdir()) == [
            f"shard_0000{i}" for i in range(3)
        ]
        assert load_rollouts(shared / name).to_dict() == expected[name]


# --- the hidden-state cache at fit start, shared by two gloo ranks -----------------------------------------------

_HIDDEN_WORKER = """
import json, os
from functools import partial
import lightning as L
import torch, torch.distributed as dist
from helpers import join_gloo
from test_rollout import PAD, tiny_lm
from test_selection_reference import _count_calls
from specdistill.head_data import HiddenCache, RolloutDataModule, build_hidden_cache
from specdistill.models.acceptance_head import AcceptanceHead
from specdistill.modules.acceptance_head import AcceptanceHeadModule
rank, (rollouts, root), out = join_gloo()
torch.set_num_threads(1)  # as the test process: the same reductions, so the same hidden states to the bit
os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # Lightning joins the running group, launches nothing
draft = tiny_lm(1, hidden=16)
calls = _count_calls(draft)
cache = HiddenCache(draft, rollouts, f"{root}/fit", batch_size=1, shard_size=2, pad_token_id=PAD, dtype="float32")
module = AcceptanceHeadModule(AcceptanceHead(16, 1, input="candidate"), None, partial(torch.optim.SGD, lr=0.1),
                              cache_hidden_states=True, hidden_cache=cache)
data = RolloutDataModule(rollouts, batch_size=1, pad_token_id=PAD, hidden_cache=cache)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=1, limit_val_batches=0, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(module, datamodule=data)
fit_calls = calls[0]
resumed = build_hidden_cache(draft, rollouts, f"{root}/resumed", batch_size=1, shard_size=2, pad_token_id=PAD,
                             dtype="float32")
dist.destroy_process_group()
json.dump({"fit_calls": fit_calls, "resumed_calls": calls[0] - fit_calls, "ready": cache.ready,
           "fit": cache.dataset.to_dict(), "resumed": resumed.to_dict()}, open(out, "w"))
"""


@pytest.mark.slow  # two fresh Python processes importing torch and Lightning: seconds, more on a loaded machine
def test_two_ranks_build_the_single_process_hidden_cache_at_fit_start_and_resume_a_started_one(tmp_path):
    """Under a two-rank DDP Trainer the hidden cache is built at fit start by `prepare_caches`: each rank runs the
    draft on its share of every shard's batches (3 shards of 2, 2 and 1 rollouts in batches of 1: 3 forwards each,
    rank 1 repeating shard 2's only batch), rank 0 merges, and both read a cache equal to one process's to the bit.
    A build another process started (shard 2 finished, the key recorded) computes only the shards it lacks."""
    import datasets

    from specdistill.caches.store import BUILDING_PREFIX
    from specdistill.head_data import build_hidden_cache
    from specdistill.head_data.hidden_cache import KEY_FILE
    from tests.test_rollout import PAD

    rollouts = tmp_path / "rollouts"
    _run((tiny_lm(0, hidden=32), tiny_lm(1, hidden=16)), rollouts)
    single = build_hidden_cache(tiny_lm(1, hidden=16), rollouts, tmp_path / "single", batch_size=1, shard_size=2,
                                pad_token_id=PAD, dtype="float32")  # fmt: skip
    shared = tmp_path / "shared"
    (shared / "resumed" / "shards").mkdir(parents=True)
    shutil.copy(tmp_path / "single" / KEY_FILE, shared / "resumed" / f"{BUILDING_PREFIX}{KEY_FILE}")
    shutil.copytree(
        tmp_path / "single" / "shards" / "shard_00002", shared / "resumed" / "shards" / "shard_00002"
    )

    results = run_gloo_ranks(_HIDDEN_WORKER, str(rollouts), str(shared), out_dir=tmp_path)

    assert [r["fit_calls"] for r in results] == [3, 3]
    assert [r["resumed_calls"] for r in results] == [2, 2]  # shards 0 and 1 only: shard 2 was kept
    expected = single.to_dict()
    for result in results:
        assert result["ready"] and result["fit"] == expected and result["resumed"] == expected  # to the bit
    for name in ("fit", "resumed"):  # one cache on disk, the same bytes; no parts or build marker left
        assert sorted(p.name for p in (shared / name).iterdir()) == ["shards", KEY_FILE]
        assert (shared / name / KEY_FILE).read_text() == (tmp_path / "single" / KEY_FILE).read_text()
        stored = datasets.load_from_disk(str(shared / name / "shards" / "shard_00000"))
        assert stored.data.table.equals(
            datasets.load_from_disk(str(tmp_path / "single" / "shards" / "shard_00000")).data.table
        )


# --- the stage: settings, and two processes launched on one node ------------------------------------------------


def _rollout_config(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=["stage=rollout", *overrides])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.devices=0"], r"rollout\.devices=0 must be a positive number"),
        (["rollout.num_nodes=1.5"], r"rollout\.num_nodes=1\.5 must be a positive number"),
        (["rollout.barrier_timeout_minutes=0"], r"rollout\.barrier_timeout_minutes=0 must be a positive"),
        (
            ["rollout.devices=2", "rollout.device=cuda:1"],
            r"rollout\.device=cuda:1 names one device.*device=auto",
        ),
        (
            ["rollout.devices=2", "++models.target.device_map=auto"],
            r"one process per node.*rollout\.devices=1",
        ),
    ],
)
def test_rank_settings_are_checked_before_anything_runs(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_ranks(_rollout_config(*overrides), "rollout")


def test_a_device_map_target_runs_one_process_per_node():
    check_ranks(_rollout_config(), "rollout")  # the default: one process
    check_ranks(_rollout_config("rollout.num_nodes=2", "++models.target.device_map=auto"), "rollout")


@pytest.mark.slow  # two train.py processes
def test_the_stage_launches_two_processes_on_one_node_and_writes_the_single_process_rollouts(tmp_path):
    """`rollout.devices=2` on a CPU node: Fabric re-launches the command for rank 1, both ranks roll out their shards
    and the rollouts are the ones the stage makes in one process."""
    target, draft = save_pair(tmp_path)
    overrides = ["models=local", f"models.target_path={target}", f"models.draft_path={draft}", *SMALL_TASK,
                 "rollout.num_prompts=6", "rollout.max_new_tokens=4", "rollout.batch_size=2", "rollout.shard_size=2",
                 "sampling=sample"]  # fmt: skip
    done = run_train(["stage=rollout", *overrides, "rollout.devices=2", f"hydra.run.dir={tmp_path / 'two'}"])
    check_ok(done)
    assert "rollouts on rank 1 of 2" in done.stdout + done.stderr
    single = rollout_stage.run(_rollout_config(*overrides), tmp_path / "one")  # here, in one process
    one, two = (load_rollouts(tmp_path / run / "rollouts" / "draft").to_dict() for run in ("one", "two"))
    labels, expected_labels = two.pop("labels"), one.pop("labels")
    assert two == one and len(two["prompt_index"]) == 6  # the same responses and draft tokens
    for row, expected in zip(labels, expected_labels, strict=True):  # other thread counts: float rounding
        assert row == pytest.approx(expected, abs=1e-6)
    result = json.loads((tmp_path / "two" / "result.json").read_text())
    assert result["draft/mean_acceptance_label"] == pytest.approx(
        single["draft/mean_acceptance_label"], abs=1e-6
    )
