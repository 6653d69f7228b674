"""Trainer presets compose, build the strategy they name with the right options, and fail early on bad hardware."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

from specdistill.utils.cluster import slurm_environment
from specdistill.utils.frozen_sharding import frozen_zero3_config, prepare_frozen
from specdistill.utils.strategy import check_devices, deepspeed_stage, deepspeed_strategy, require_deepspeed

CONF = Path(__file__).resolve().parents[1] / "conf"
PRESETS = ["cpu", "gpu", "ddp", "deepspeed_zero2", "deepspeed_zero3"]
SLURM_VARS = ["SLURM_NTASKS", "SLURM_JOB_NAME", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", "SLURM_PROCID"]


@pytest.fixture(autouse=True)
def _no_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests run as if outside SLURM unless they set the variables themselves."""
    for name in SLURM_VARS:
        monkeypatch.delenv(name, raising=False)


def trainer_cfg(preset: str, *overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=[f"trainer={preset}", *overrides]).trainer


# ids avoid a bare "gpu", which the conftest would read as the gpu marker
@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: f"trainer={p}")
def test_every_preset_composes_with_clipping_and_precision(preset: str) -> None:
    cfg = trainer_cfg(preset)
    assert cfg._target_ == "lightning.Trainer"
    assert cfg.gradient_clip_val == 1.0
    assert cfg.precision == ("32-true" if preset == "cpu" else "bf16-mixed")
    # accumulation is a trainer setting (one home); the loss normalisation reads it from the Trainer
    assert cfg.accumulate_grad_batches == 1


def test_ddp_preset_builds_ddp_strategy_without_unused_parameter_search() -> None:
    cfg = trainer_cfg("ddp")
    assert cfg.num_nodes == 1 and cfg.devices == "auto"
    strategy = instantiate(cfg.strategy)
    assert isinstance(strategy, DDPStrategy)
    assert strategy._ddp_kwargs["find_unused_parameters"] is False
    assert strategy.cluster_environment is None  # outside SLURM Lightning picks its default environment


@pytest.mark.parametrize(
    ("preset", "overrides", "expected"),
    [
        ("deepspeed_zero2", [], {"stage": 2, "offload_optimizer": None, "offload_param": None}),
        (
            "deepspeed_zero2",
            ["trainer.strategy.offload_optimizer=true", "trainer.strategy.reduce_bucket_size=5e7"],
            {"stage": 2, "offload_optimizer": "cpu", "offload_param": None, "reduce_bucket_size": 50_000_000},
        ),
        ("deepspeed_zero3", [], {"stage": 3, "offload_optimizer": None, "offload_param": None}),
        (
            "deepspeed_zero3",
            ["trainer.strategy.offload_optimizer=true", "trainer.strategy.offload_parameters=true"],
            {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
        ),
    ],
)
def test_deepspeed_presets_build_the_strategy_with_their_stage_and_offload(
    preset, overrides, expected
) -> None:
    strategy = instantiate(trainer_cfg(preset, *overrides).strategy)
    assert isinstance(strategy, DeepSpeedStrategy)
    zero = strategy.config["zero_optimization"]
    assert zero["stage"] == expected["stage"] == deepspeed_stage(strategy)
    assert (zero.get("offload_optimizer") or {}).get("device") == expected["offload_optimizer"]
    assert (zero.get("offload_param") or {}).get("device") == expected["offload_param"]
    assert zero["allgather_bucket_size"] == 200_000_000
    assert zero["reduce_bucket_size"] == expected.get("reduce_bucket_size", 200_000_000)
    if expected["stage"] == 3:
        assert zero["stage3_prefetch_bucket_size"] == 50_000_000
        assert zero["stage3_param_persistence_threshold"] == 100_000


def test_deepspeed_strategy_rejects_bad_options() -> None:
    with pytest.raises(ValueError, match="stage 3"):
        deepspeed_strategy(stage=2, offload_parameters=True)
    with pytest.raises(ValueError, match="1, 2 or 3"):
        deepspeed_strategy(stage=4)
    with pytest.raises(ValueError, match="zero_extra"):
        deepspeed_strategy(stage=2, config={"zero_optimization": {"stage": 2}})


def test_missing_deepspeed_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # what an uninstalled package looks like to find_spec
    with pytest.raises(ImportError, match=r"pip install 'specdistill\[deepspeed\]'"):
        require_deepspeed()
    with pytest.raises(InstantiationException, match=r"pip install 'specdistill\[deepspeed\]'"):
        instantiate(trainer_cfg("deepspeed_zero3").strategy)


def test_cpu_preset_builds_a_trainer_after_the_device_check(tmp_path: Path) -> None:
    cfg = trainer_cfg("cpu")
    check_devices(cfg)
    trainer = instantiate(cfg, default_root_dir=str(tmp_path), logger=False, max_steps=1)
    assert isinstance(trainer, L.Trainer)
    assert trainer.gradient_clip_val == 1.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
@pytest.mark.parametrize(
    "preset", ["gpu", "ddp", "deepspeed_zero2", "deepspeed_zero3"], ids=lambda p: f"trainer={p}"
)
def test_gpu_presets_on_a_machine_without_cuda_say_to_use_cpu(preset: str) -> None:
    with pytest.raises(ValueError, match="trainer=cpu"):
        check_devices(trainer_cfg(preset))


def test_more_devices_than_visible_gpus_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_devices(trainer_cfg("ddp", "trainer.devices=2"))
    check_devices(trainer_cfg("ddp", "trainer.devices=[0,1]"))
    with pytest.raises(ValueError, match="only 2 are visible"):
        check_devices(trainer_cfg("ddp", "trainer.devices=4"))


def test_more_nodes_than_the_job_has_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    with pytest.raises(ValueError, match="hydra.launcher.nodes=2"):
        check_devices(trainer_cfg("ddp", "trainer.num_nodes=2"))  # a single machine, no SLURM
    monkeypatch.setenv("SLURM_NNODES", "2")
    assert trainer_cfg("ddp").num_nodes == 2  # the preset follows the allocation
    check_devices(trainer_cfg("ddp"))
    with pytest.raises(ValueError, match="runs on 2 node"):
        check_devices(trainer_cfg("ddp", "trainer.num_nodes=4"))


def test_slurm_tasks_give_world_size_and_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    assert slurm_environment() is None
    env = {
        "SLURM_NTASKS": "16",
        "SLURM_NTASKS_PER_NODE": "8",
        "SLURM_JOB_NAME": "train",
        "SLURM_PROCID": "9",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_NNODES": "2",
        "SLURM_NODELIST": "gpu[01-02]",
        "SLURM_JOB_ID": "1234",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    strategy = instantiate(trainer_cfg("ddp").strategy)
    cluster = strategy.cluster_environment
    assert isinstance(cluster, SLURMEnvironment)
    assert not cluster.auto_requeue  # PreemptionCheckpoint owns the requeue signal
    assert (cluster.world_size(), cluster.global_rank(), cluster.local_rank(), cluster.node_rank()) == (
        16,
        9,
        1,
        1,
    )
    assert cluster.main_address == "gpu01"
    ds = instantiate(trainer_cfg("deepspeed_zero3").strategy)
    assert isinstance(ds.cluster_environment, SLURMEnvironment)


def tiny_model() -> torch.nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    return GPTNeoXForCausalLM(config)


def test_frozen_zero3_config_scales_buckets_with_the_hidden_size() -> None:
    config = frozen_zero3_config(tiny_model(), "bf16-mixed", offload_parameters=True)
    zero = config["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["stage3_param_persistence_threshold"] == 320
    assert zero["reduce_bucket_size"] == 1024
    assert zero["offload_param"]["device"] == "cpu"
    assert config["bf16"]["enabled"] and not config["fp16"]["enabled"]
    assert "optimizer" not in config


def test_prepare_frozen_places_a_frozen_model_and_refuses_a_trainable_one(tmp_path: Path) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, default_root_dir=str(tmp_path))
    model = tiny_model()
    with pytest.raises(ValueError, match="trainable"):
        prepare_frozen(model, trainer)
    model.requires_grad_(False)
    placed = prepare_frozen(model, trainer, dtype="bfloat16")
    assert placed is model and not placed.training
    assert next(placed.parameters()).dtype == torch.bfloat16
    assert next(placed.parameters()).device.type == "cpu"
    with pytest.raises(ValueError, match="dtype"):
        prepare_frozen(model, trainer, dtype="int8")


def test_full_weights_is_a_no_op_outside_zero3(tmp_path: Path) -> None:
    from specdistill.utils.strategy import full_weights

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, default_root_dir=str(tmp_path))
    model = tiny_model()
    with full_weights(model, trainer) as gathered:
        assert gathered is model and next(gathered.parameters()).numel() > 0


def test_converting_a_single_file_checkpoint_says_what_a_deepspeed_one_is(tmp_path: Path) -> None:
    from specdistill.utils.strategy import deepspeed_checkpoint_to_hf

    single = tmp_path / "last.ckpt"
    single.write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="not a DeepSpeed checkpoint directory"):
        deepspeed_checkpoint_to_hf(single, tiny_model, tmp_path / "out")


# -- DeepSpeed ZeRO-3 on CPU (gloo): frozen-model sharding and checkpoint conversion with the real engine -------------


class DraftHolder(torch.nn.Module):
    """Stands where DistillModule stands: the trainable model under `draft` (so checkpoint keys are `draft.*`)."""

    def __init__(self, draft: torch.nn.Module) -> None:
        super().__init__()
        self.draft = draft

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.draft(input_ids=input_ids).logits.float().pow(2).mean()


def _zero3_on_cpu(out_dir: str, port: int) -> None:
    """Runs in a child process: DeepSpeed's process group and globals must not leak into the test session."""
    from types import SimpleNamespace

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    import deepspeed
    from transformers import AutoModelForCausalLM

    from specdistill.decoding.sampling import SamplingConfig
    from specdistill.head_data import RolloutCollator, judged_head_inputs
    from specdistill.utils.frozen_sharding import is_deepspeed_engine
    from specdistill.utils.strategy import deepspeed_checkpoint_to_hf

    # one process needs no shared-memory collectives: without this, init_distributed JIT-compiles DeepSpeed's C++
    # shm op (65-140 s on two cores, longer under load), which is what made this test time out in CI
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 8))

    # a frozen target becomes a ZeRO-3 engine without optimizer that computes what the plain model computes
    target = tiny_model().requires_grad_(False)
    target.eval()
    # acceptance-head inputs read the frozen draft's base model and LM head separately: both must gather
    row = {"prompt_index": 0, "prompt_ids": [1, 2, 3], "response_ids": [4, 5, 6, 7],
           "draft_tokens": [4, 9, 6, 2], "labels": [1.0, 0.0, 1.0, 0.5]}  # fmt: skip
    head_batches = {mode: RolloutCollator(0, 0.15, 0, mode)([row]) for mode in ("candidate", "proposer")}
    greedy = SamplingConfig(greedy=True)
    with torch.no_grad():
        expected = target(input_ids=ids).logits
        expected_heads = {m: judged_head_inputs(target, b, m, greedy) for m, b in head_batches.items()}
    trainer = SimpleNamespace(strategy=DeepSpeedStrategy(stage=3), precision="32-true")
    engine = prepare_frozen(target, trainer)
    assert (
        is_deepspeed_engine(engine) and not engine.module.training
    )  # DeepSpeedEngine.eval() sets the module's
    assert not any(p.requires_grad for p in engine.module.parameters())
    assert all(hasattr(p, "ds_id") for p in engine.module.parameters())  # partitioned by ZeRO-3
    with torch.no_grad():
        torch.testing.assert_close(engine(input_ids=ids).logits, expected)
        for mode, batch in head_batches.items():
            torch.testing.assert_close(judged_head_inputs(engine, batch, mode, greedy), expected_heads[mode])
    assert prepare_frozen(engine, trainer) is engine

    # a ZeRO-3 checkpoint of a trained draft converts to the HF export of the same weights
    holder = DraftHolder(tiny_model())
    initial = {k: v.clone() for k, v in holder.draft.state_dict().items()}
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
    }
    trained, *_ = deepspeed.initialize(model=holder, config=config, model_parameters=holder.parameters())
    trained.backward(trained(ids))
    trained.step()
    ckpt = Path(out_dir) / "last.ckpt"
    # the layout Lightning's DeepSpeedStrategy writes: <ckpt>/checkpoint/*_model_states.pt + optimizer shards
    trained.save_checkpoint(str(ckpt), client_state={"global_step": 1}, tag="checkpoint")
    with deepspeed.zero.GatheredParameters(list(holder.parameters())):
        weights = {k: v.clone() for k, v in holder.draft.state_dict().items()}
    with pytest.raises(FileNotFoundError, match="no specdistill_fingerprint.json"):
        deepspeed_checkpoint_to_hf(ckpt, lambda: DraftHolder(tiny_model()), Path(out_dir) / "refused")
    export = deepspeed_checkpoint_to_hf(
        ckpt, lambda: DraftHolder(tiny_model()), Path(out_dir) / "export", trust_unsigned=True
    )
    reloaded = AutoModelForCausalLM.from_pretrained(export).state_dict()
    assert reloaded.keys() == weights.keys()
    for name, tensor in reloaded.items():
        torch.testing.assert_close(tensor, weights[name])
    assert any(not torch.equal(weights[k], initial[k]) for k in weights)  # the step changed the draft


def test_zero3_frozen_engine_and_checkpoint_conversion_on_cpu(tmp_path: Path) -> None:
    import multiprocessing
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    child = multiprocessing.get_context("spawn").Process(
        target=_zero3_on_cpu, args=(str(tmp_path), port), daemon=True
    )
    child.start()
    child.join(timeout=240)
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == 0, "the ZeRO-3 checks failed in the child process (see its output above)"
