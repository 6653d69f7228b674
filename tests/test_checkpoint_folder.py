"""A DeepSpeed checkpoint is a folder every rank writes its shards into: it must appear whole and signed or not at all.

DeepSpeed itself needs CUDA under Lightning, so the strategy here is Lightning's `DeepSpeedStrategy` with its save
replaced by one that writes DeepSpeed's layout (`<ckpt>/checkpoint/*_model_states.pt`, `latest`) file by file and can
be made to fail midway; `RunFingerprint` wraps it exactly as it wraps the real one.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from lightning.pytorch.strategies import DeepSpeedStrategy

from specdistill.callbacks.fingerprint import RunFingerprint
from specdistill.errors import DiskFullError
from specdistill.utils.fingerprint import CHECKPOINT_SIGNATURE
from specdistill.utils.run_dir import check_checkpoint

FINGERPRINT = {"models": "m", "fingerprint": "f", "config": {"models": {}}}
SHARDS = ("zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt")


class ShardWriter(DeepSpeedStrategy):
    """Writes a DeepSpeed-shaped folder holding `version`; `fail_after` files, then raises `failure`."""

    def __init__(self) -> None:
        super().__init__(stage=3)
        self.fail_after: int | None = None
        self.failure: BaseException = RuntimeError("killed")
        self.barriers = 0

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        folder = Path(filepath) / "checkpoint"
        folder.mkdir(parents=True, exist_ok=True)
        for written, name in enumerate([*SHARDS, "../latest"]):
            if self.fail_after is not None and written == self.fail_after:
                raise self.failure
            (folder / name).write_text(str(checkpoint["version"]))

    def barrier(self, name: str | None = None) -> None:
        self.barriers += 1


def _trainer() -> SimpleNamespace:
    trainer = SimpleNamespace(strategy=ShardWriter(), is_global_zero=True)
    RunFingerprint(FINGERPRINT).setup(trainer, None, "fit")
    return trainer


def _version(path: Path) -> set[str]:
    files = [path / "checkpoint" / name for name in SHARDS] + [path / "latest"]
    return {f.read_text() for f in files}


def test_a_folder_checkpoint_appears_whole_and_signed(tmp_path: Path) -> None:
    trainer = _trainer()
    last = tmp_path / "checkpoints" / "last.ckpt"
    trainer.strategy.save_checkpoint({"version": 1}, last)
    assert _version(last) == {"1"}
    assert json.loads((last / CHECKPOINT_SIGNATURE).read_text()) == {"fingerprint": "f", "models": "m"}
    check_checkpoint(last, "f")  # signed by this run: resumable
    trainer.strategy.save_checkpoint({"version": 2}, last)
    assert _version(last) == {"2"}
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]  # nothing staged is left
    assert trainer.strategy.barriers == 6  # every rank waits before, between and after


@pytest.mark.parametrize("fail_after", [0, 1, 2])
def test_a_save_that_dies_midway_leaves_the_previous_checkpoint(tmp_path: Path, fail_after: int) -> None:
    trainer = _trainer()
    last = tmp_path / "last.ckpt"
    trainer.strategy.save_checkpoint({"version": 1}, last)
    trainer.strategy.fail_after = fail_after
    with pytest.raises(RuntimeError, match="killed"):
        trainer.strategy.save_checkpoint({"version": 2}, last)
    assert _version(last) == {"1"}  # the old checkpoint, whole, never a mix of the two
    check_checkpoint(last, "f")
    trainer.strategy.fail_after = None  # the relaunch saves again over the leftovers
    trainer.strategy.save_checkpoint({"version": 3}, last)
    assert _version(last) == {"3"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_full_disk_during_a_folder_save_says_so_and_keeps_the_previous_one(tmp_path: Path) -> None:
    trainer = _trainer()
    last = tmp_path / "last.ckpt"
    trainer.strategy.save_checkpoint({"version": 1}, last)
    trainer.strategy.fail_after = 1
    trainer.strategy.failure = OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(DiskFullError, match=r"last\.ckpt could not be written: the disk is full"):
        trainer.strategy.save_checkpoint({"version": 2}, last)
    assert _version(last) == {"1"}
