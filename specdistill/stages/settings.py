"""Typed settings of each stage: `conf/<stage>/default.yaml` names one of these dataclasses as its `_target_`.

`build_settings(cfg, stage)` builds the stage's dataclass from `cfg.<stage>` with Hydra's `instantiate` (not
recursively: the nested blocks `optimizer`, `scheduler`, `model`, `policies`, `trainer`, `vllm` and `sampling` stay
plain dicts, built by the stage or merged by `stages/trainer.py::trainer_config` as before; interpolations are
resolved). A key that no field reads is refused by construction, with a `ConfigError` naming the key and the stage;
every range check of a setting lives in its dataclass's `__post_init__`, so train.py (`specdistill/validation.py`) and
the stage itself refuse the same values with the same one-line message. Checks that span groups (models vs a stage, a pipeline's
steps) stay in `specdistill/validation.py`.

The run fingerprint hashes the composed `cfg.<stage>` node minus its `_target_` (specdistill/utils/fingerprint.py),
so the fingerprints of runs made before these classes existed are unchanged.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig

from specdistill.data.target_source import TargetSource, source_from_setting
from specdistill.errors import ConfigError, UserError
from specdistill.tasks.base import SPLITS

if TYPE_CHECKING:
    from specdistill.decoding.sampling import SamplingConfig

T = TypeVar("T")
# who generates the target's text: our models through transformers, or vLLM (rollout and target_answers alike)
BACKENDS = ("transformers", "vllm")
ONE_PROCESS_DEVICES = ("auto", "cuda", "cpu")  # device types: each process of several takes its own device


# -- building -------------------------------------------------------------------------------------------------------


def build_settings(cfg: DictConfig, stage: str) -> StageSettings:
    """The typed settings of `stage` from `cfg.<stage>` (the class its `_target_` names).

    Raises:
        ConfigError: a key no field reads, a missing key, or a value out of range; the message names `<stage>.<key>`.
    """
    node = cfg.get(stage)
    if not isinstance(node, DictConfig) or "_target_" not in node:
        raise ConfigError(
            f"`{stage}` is not a stage's settings group (it needs the `_target_` of conf/{stage}/default.yaml): "
            f"compose it with stage={stage}, or a pipeline whose steps include it."
        )
    cls = get_class(str(node._target_))
    check_keys(cls, stage, [str(key) for key in node if key != "_target_"])
    try:
        return instantiate(node, _recursive_=False, _convert_="all")
    except InstantiationException as error:  # Hydra wraps what the constructor raised
        if isinstance(error.__cause__, UserError):
            raise error.__cause__ from None
        raise


def check_keys(cls: type, where: str, keys: list[str]) -> None:
    """Refuse keys that are not fields of the dataclass `cls`, and required fields that are missing.

    Args:
        cls: a dataclass.
        where: the dotted config path of the block (`adaspec`, `evaluate.acceptance_head`), for the message.
        keys: the block's keys.
    """
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = [key for key in keys if key not in names]
    if unknown:
        key = unknown[0]
        hint = difflib.get_close_matches(key, names, n=1)
        raise ConfigError(
            f"{where}.{key}: the {where} settings have no key {key!r}, so nothing would read it"
            + (f" (did you mean {where}.{hint[0]}?)" if hint else "")
            + f"; {where} has: {', '.join(names)}."
        )
    required = [
        f.name
        for f in dataclasses.fields(cls)
        if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    missing = [name for name in required if name not in keys]
    if missing:
        raise ConfigError(
            f"{where}.{missing[0]} is missing: the {where} settings need it (its default is in "
            f"conf/{where.split('.')[0]}/default.yaml); do not delete it with ~{where}.{missing[0]}."
        )


def build_block(cls: type[T], where: str, values: Mapping[str, Any]) -> T:
    """A nested block (e.g. `evaluate.acceptance_head`) as the dataclass `cls`, its keys checked as a stage's."""
    if isinstance(values, cls):
        return values
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where}={values!r} must be a block of settings ({where}.<key>=<value>).")
    check_keys(cls, where, [str(key) for key in values])
    return cls(**values)


# -- range checks ---------------------------------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)


def check_count(where: str, key: str, value: Any, *, minimum: int = 1, optional: bool = False) -> None:
    """`<where>.<key>` is an integer >= `minimum` (or null when `optional`)."""
    if optional and value is None:
        return
    if not _is_int(value) or value < minimum:
        raise ConfigError(
            f"{where}.{key}={value!r} must be an integer >= {minimum}" + (" (or null)" if optional else "")
            + f", e.g. {where}.{key}={max(minimum, 1)}."
        )  # fmt: skip


def check_number(
    where: str,
    key: str,
    value: Any,
    low: float,
    high: float,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """`<where>.<key>` is a number in the interval from `low` to `high` (open where said)."""
    inside = _is_number(value) and (value > low if low_open else value >= low)
    inside = inside and (value < high if high_open else value <= high)
    if not inside:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ConfigError(f"{where}.{key}={value!r} must be a number in {interval}.")


def check_choice(where: str, key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(
            f"{where}.{key}={value!r} is not one of {', '.join(choices)}, e.g. {where}.{key}={choices[0]}."
        )


# -- stages ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class StageSettings:
    """Base of every stage's settings; `group` is the config group they come from (the key in messages)."""

    group: ClassVar[str]


@dataclass(frozen=True, kw_only=True)
class TrainingSettings(StageSettings):
    """What every training stage has: optimizer, schedule, the global batch plan and its own `trainer:` block."""

    optimizer: dict[str, Any]
    """Partial optimizer (`_partial_: true`), built with the parameters by the module (conf/optimizer/)."""
    scheduler: dict[str, Any]
    """Partial learning-rate schedule (`_partial_: true`, conf/scheduler/)."""
    batch_size: int
    """Global batch: examples per optimizer step over all devices (docs/PRESETS.md)."""
    micro_batch_size: int | None
    """Examples per device and forward pass; accumulation = batch_size / (world x this); null: batch_size / world."""
    trainer: dict[str, Any] = field(default_factory=dict)
    """Merged into `trainer` for this stage (`stages/trainer.py::trainer_config`; `trainer.<key>` on the command line
    wins)."""

    def __post_init__(self) -> None:
        check_count(self.group, "batch_size", self.batch_size)
        check_count(self.group, "micro_batch_size", self.micro_batch_size, optional=True)


@dataclass(frozen=True, kw_only=True)
class TaskTrainingSettings(TrainingSettings):
    """A training stage on the task's examples (sft, distill, adaspec)."""

    eval_batch_size: int | None
    """Examples per validation batch (null: the micro-batch)."""
    max_length: int
    """Tokens per example (prompt and answer)."""
    optimal_epochs: int | None = None
    """The epochs the authors chose on validation for this pair and task (conf/tuning/; experiment=adaspec_optimal)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_count(self.group, "eval_batch_size", self.eval_batch_size, optional=True)
        check_count(self.group, "max_length", self.max_length)
        check_count(self.group, "optimal_epochs", self.optimal_epochs, optional=True)


@dataclass(frozen=True, kw_only=True)
class SFTSettings(TaskTrainingSettings):
    """Target fine-tuning (docs/METHODS.md section 1)."""

    group: ClassVar[str] = "sft"
    eval_examples: int | None
    """Greedy generations on the test split that report the target's task metric (0 or null skips it)."""
    eval_max_new_tokens: int
    """Most new tokens of each of those generations."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_count(self.group, "eval_examples", self.eval_examples, minimum=0, optional=True)
        check_count(self.group, "eval_max_new_tokens", self.eval_max_new_tokens)


@dataclass(frozen=True, kw_only=True)
class DistillSettings(TaskTrainingSettings):
    """DistillSpec-style distillation on every answer token (docs/METHODS.md section 2)."""

    group: ClassVar[str] = "distill"
    target_cache: int | str | None = None
    """Where training reads the target (`specdistill.data.target_source`): null, the live target on every batch; an
    integer m (e.g. 64), its top-m answer distributions cached once, so training runs without the target; bfloat16,
    float16 or float32, for a draft kind that reads the target's hidden states (draft=eagle3), those states cached
    once in that precision (float32: exact, twice the size), so the target's body never runs in training (large, see
    specdistill/data/target_states.py). Both are built at fit start over train and validation, in
    `target_cache_dir`."""
    target_cache_dir: str | None = None
    """Where the stage's target cache lives (null: `target_cache/` in the stage's folder). Stages given one folder
    share one cache: it is keyed by the target's weights, the tokenizer, the tokenised data and m (or the layers and
    dtype), reused when they match and rebuilt when they do not (a pipeline hands the distill step's folder to the
    adaspec step: one target pass for both)."""
    select_best: str | None = None
    """A validation metric (e.g. val/expected_acceptance): export the best validation epoch (optimal-epoch regime)."""
    packing: bool = False
    """Lay each micro-batch's examples end to end in rows of `max_length` (`specdistill/data/packing.py`): each example
    still attends only to itself, and a batch carries answer tokens instead of padding. For draft kinds that support
    it (draft=eagle3), with the live target or its cached states."""
    init: str | None = None
    """An export directory the draft continues from (a standalone draft: e.g. the previous phase's draft in
    stage=sequential); null: the pair's `models.draft`."""

    def __post_init__(self) -> None:
        super().__post_init__()
        source_from_setting(self.group, self.target_cache)  # refuses a value that names no source

    def target_source(self, kind: Any) -> TargetSource:
        """The source `target_cache` names, checked against the draft `kind` (`TargetSource.check_kind`)."""
        source = source_from_setting(self.group, self.target_cache)
        source.check_kind(kind)
        return source

    def target_cache_path(self, out_dir: Path) -> Path:
        """The target cache's directory for a stage writing to `out_dir`."""
        return Path(self.target_cache_dir) if self.target_cache_dir else out_dir / "target_cache"


@dataclass(frozen=True, kw_only=True)
class AdaSpecSettings(DistillSettings):
    """AdaSPEC selective distillation (docs/METHODS.md section 3); the selector is the `selector` group."""

    group: ClassVar[str] = "adaspec"
    reference: str | None = None
    """Export directory of a distill run (a pipeline fills it)."""
    k: float
    """Kept fraction of answer tokens, (0, 1]: the one key for it (selection and compute matching read it)."""
    cached_scores: bool
    """Score the reference once and read the scores (false: run the reference every step)."""
    compute_matched: bool
    """The authors' protocol: batch and micro-batch / k, exactly the baseline's optimizer steps."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not _is_number(self.k) or not 0 < self.k <= 1:
            raise ConfigError(
                f"{self.group}.k={self.k!r}: the fraction of answer tokens AdaSPEC trains on must be in (0, 1], e.g. "
                f"{self.group}.k=0.4 (1.0 trains on every token, as DistillSpec)."
            )
        object.__setattr__(self, "k", float(self.k))  # as the selector and the result record it


@dataclass(frozen=True, kw_only=True)
class AcceptanceHeadSettings(TrainingSettings):
    """SpecDec++ acceptance heads, one per draft, trained on its rollouts (docs/METHODS.md section 4)."""

    group: ClassVar[str] = "acceptance_head"
    rollouts: dict[str, str]
    """Draft name -> rollout directory (a pipeline fills them)."""
    drafts: dict[str, str]
    """Draft name -> export directory of the draft whose hidden states the head reads."""
    model: dict[str, Any]
    """The head (`_target_`), built with the draft's hidden size."""
    w_acc: float
    """Weight of accepted tokens in the soft-label BCE."""
    w_rej: float
    """Weight of rejected tokens (the paper: 1, 3, 6 or 12)."""
    mixing_ratio: float
    """Candidate heads: probability of keeping the target token instead of the draft's, [0, 1]."""
    cache_hidden_states: bool
    """Run the frozen draft once, store its hidden states, and train the head on the cache."""
    hidden_cache_dtype: str
    """dtype of that cache (e.g. float16)."""
    reliability_bins: int
    """Bins of the reliability diagram."""
    val_fraction: float
    """Fraction of the rollouts held out for validation, [0, 1)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("w_acc", "w_rej"):
            check_number(self.group, key, getattr(self, key), 0.0, math.inf, low_open=True, high_open=True)
        check_number(self.group, "mixing_ratio", self.mixing_ratio, 0.0, 1.0)
        check_number(self.group, "val_fraction", self.val_fraction, 0.0, 1.0, high_open=True)
        check_count(self.group, "reliability_bins", self.reliability_bins)


@dataclass(frozen=True, kw_only=True)
class TargetAnswersSettings(StageSettings):
    """The target's own answers to the task's prompts (greedy, or sampled at the serving temperature), for the drafts
    to learn from (docs/METHODS.md section 2)."""

    group: ClassVar[str] = "target_answers"
    splits: list[str]
    """The task's splits answered (train for training, validation for `val/` metrics)."""
    max_prompts: int | None
    """Most prompts answered per split, the first ones in split order (null: every one)."""
    max_new_tokens: int
    """Most tokens of each answer; an answer that reaches it is cut there (EOS is still appended in training)."""
    batch_size: int
    """Prompts per generate call (sorted by length, so a batch pads little)."""
    max_length: int
    """Prompt tokenisation, as in training (longer prompts keep their last tokens)."""
    device: str
    """auto (CUDA when available), cuda or cpu."""
    sampling: dict[str, Any]
    """How each answer token is chosen (conf/sampling/; greedy by default, or e.g. the serving temperature)."""
    backend: str
    """transformers: our models, in this process; vllm: vLLM generates (the target loaded by hub id or directory)."""
    vllm: dict[str, Any]
    """vllm.LLM arguments (backend=vllm), handed whole to vLLM."""
    vllm_python: str | None
    """backend=vllm: the Python of an environment with vLLM; null: this one."""
    shard_size: int
    """Prompts per shard, the unit of resumption (a multiple of batch_size keeps the unsharded batches)."""

    def __post_init__(self) -> None:
        where = self.group
        if not self.splits or any(split not in SPLITS for split in self.splits):
            raise ConfigError(
                f"{where}.splits={list(self.splits)!r}: name one or more of {list(SPLITS)}, e.g. "
                f"{where}.splits=[train,validation]."
            )
        check_count(where, "max_prompts", self.max_prompts, optional=True)
        for key in ("max_new_tokens", "batch_size", "max_length", "shard_size"):
            check_count(where, key, getattr(self, key))
        check_choice(where, "backend", self.backend, BACKENDS)
        self.decoding()  # the sampling block's own checks

    def decoding(self) -> SamplingConfig:
        """`sampling` as the project's warping (its keys and ranges checked; errors name `target_answers.sampling`)."""
        from specdistill.decoding.sampling import SamplingConfig  # torch: not imported to check a config

        try:
            return build_block(SamplingConfig, f"{self.group}.sampling", self.sampling)
        except ConfigError:  # a key no field reads: build_block's message names it
            raise
        except ValueError as error:
            raise ConfigError(
                f"{self.group}.sampling: {error}; e.g. {self.group}.sampling.temperature=0.6."
            ) from None


@dataclass(frozen=True, kw_only=True)
class RolloutSettings(StageSettings):
    """SpecDec++ rollouts: target responses, draft tokens and their soft labels (docs/METHODS.md section 4)."""

    group: ClassVar[str] = "rollout"
    drafts: dict[str, str]
    """Name -> draft export directory (a pipeline fills them); {}: models.draft."""
    split: str
    """The split whose prompts are rolled out."""
    num_prompts: int | None
    """Prompts rolled out (null or 0: every prompt of the split)."""
    max_new_tokens: int
    """Most tokens of each target response."""
    backend: str
    """hf: our batched sampling loop on the transformers target; vllm: responses from vLLM."""
    vllm: dict[str, Any]
    """vllm.LLM arguments (backend=vllm), handed whole to vLLM."""
    vllm_python: str | None
    """backend=vllm: the Python of an environment with vLLM; null: this one."""
    batch_size: int
    """Prompts per generate call."""
    shard_size: int
    """Prompts per shard: the unit of resumption."""
    label_temperature_one: bool
    """true: the public code's T=1 labelling (a mismatch when decoding is warped)."""
    max_length: int
    """Prompt tokenisation, as in training."""
    device: str
    """auto (CUDA when available), cuda or cpu; one process: also e.g. cuda:1."""
    devices: int
    """Processes per node sharing the shards."""
    num_nodes: int
    """Nodes."""
    barrier_timeout_minutes: float
    """How long a rank waits for the slowest one to finish its last shard."""

    def __post_init__(self) -> None:
        where = self.group
        check_count(where, "num_prompts", self.num_prompts, minimum=0, optional=True)
        for key in ("max_new_tokens", "batch_size", "shard_size", "max_length"):
            check_count(where, key, getattr(self, key))
        check_choice(where, "backend", self.backend, BACKENDS)
        for key in ("devices", "num_nodes"):
            value = getattr(self, key)
            if not _is_int(value) or value <= 0:
                raise ConfigError(f"{where}.{key}={value!r} must be a positive number, e.g. {where}.{key}=1.")
        timeout = self.barrier_timeout_minutes
        if not _is_number(timeout) or timeout <= 0:
            raise ConfigError(
                f"{where}.barrier_timeout_minutes={timeout!r} must be a positive number, e.g. "
                f"{where}.barrier_timeout_minutes=1."
            )
        processes = self.devices * self.num_nodes
        if processes > 1 and str(self.device) not in ONE_PROCESS_DEVICES:
            raise ConfigError(
                f"{where}.device={self.device} names one device, but {where}.devices={self.devices} x "
                f"{where}.num_nodes={self.num_nodes} processes each take their own: set {where}.device=auto (or cuda, "
                "cpu), and CUDA_VISIBLE_DEVICES to choose the GPUs."
            )
        if self.backend == "vllm" and processes != 1:
            raise ConfigError(
                f"{where}.backend=vllm runs one process that spreads the target over the node's GPUs itself "
                f"({where}.vllm.tensor_parallel_size): set {where}.devices=1 and {where}.num_nodes=1."
            )


@dataclass(frozen=True, kw_only=True)
class MeasurementSettings(StageSettings):
    """Drafts teacher-forced against the target on a split's answers (`analyse`, `sequential`'s measurement)."""

    split: str
    """The split whose answers are teacher-forced (validation or train; never test: these are not the reported
    metric)."""
    max_examples: int | None
    """The first this many examples of `split` (per task; null: all)."""
    batch_size: int
    """Examples per forward pass."""
    max_length: int
    """Tokens per example (prompt and answer), as in training."""
    device: str
    """auto: cuda when available, else cpu."""

    def __post_init__(self) -> None:
        where = self.group
        check_choice(where, "split", self.split, ("validation", "train"))
        check_count(where, "max_examples", self.max_examples, optional=True)
        for key in ("batch_size", "max_length"):
            check_count(where, key, getattr(self, key))


@dataclass(frozen=True, kw_only=True)
class AnalyseSettings(MeasurementSettings):
    """Token-level diagnostics of every draft against the target on the same answers (docs/METHODS.md section 3)."""

    group: ClassVar[str] = "analyse"
    drafts: dict[str, str]
    """Name -> draft export directory (a pipeline fills them); {}: models.draft."""
    baseline: str | None
    """The draft the others are compared with in the paper's directions (e.g. distillspec); null: none."""


@dataclass(frozen=True, kw_only=True)
class SequentialSettings(MeasurementSettings):
    """Sequential multi-task distillation: DistillSpec and AdaSPEC on one task, then the next, each task's
    acceptance measured on its `split` answers after every phase (specdistill/stages/sequential.py)."""

    group: ClassVar[str] = "sequential"
    phases: list[str]
    """The tasks in training order, by their names in `tasks` (at least two, each once)."""
    tasks: dict[str, Any]
    """Name -> task config (composed from conf/task/, e.g. `/task@sequential.tasks.math: arith`)."""
    epochs: int | None
    """Epochs of each phase's distill and adaspec steps (their `trainer.max_epochs`; a `max_steps` still caps them);
    null: the steps' own."""
    target_answers: bool
    """Each phase starts with a `target_answers` step on its task (`target_answers` settings), and the drafts train
    and are measured on the target's own answers to its prompts (for a pretrained target, whose answers the
    datasets' do not resemble); false: the tasks' answers (`answers_from` as each task sets it)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        where = self.group
        if len(self.phases) < 2 or len(set(self.phases)) != len(self.phases):
            raise ConfigError(
                f"{where}.phases={list(self.phases)}: sequential training needs at least two tasks, each named once "
                f"(e.g. {where}.phases=[code,math])"
            )
        unknown = [name for name in self.phases if name not in self.tasks]
        if unknown:
            raise ConfigError(
                f"{where}.phases names {unknown}, which {where}.tasks does not hold (it holds {sorted(self.tasks)}); "
                f"add one with +{where}.tasks.<name>=... or a defaults entry /task@{where}.tasks.<name>: <task>"
            )
        check_count(where, "epochs", self.epochs, optional=True)


HEAD_STOPS = ("plain", "withdrawn", "padded")  # what a head policy's stop may do to the round


@dataclass(frozen=True, kw_only=True)
class HeadPolicyGrid:
    """`evaluate.acceptance_head`: one policy per threshold h, stop once 1 - prod(acceptance) > h."""

    thresholds: list[float]
    """The h grid; the fastest on the selection split is reported."""
    min_draft_length: int
    """Candidates drafted before the head may stop (the public SpecDec++ code drafts at least 2)."""
    score_newest: bool | list[bool]
    """Candidate heads: false = the public code's rule; true = score the newest candidate first; [false, true] =
    choose on the selection split. Proposer heads always score the newest candidate."""
    stops: list[str]
    """What a head policy's stop does to the round, one policy per entry, chosen on the selection split: `plain` (the
    public rule: drafting ends after the candidate it lands on), `withdrawn` (that candidate is withdrawn: the target
    verifies the ones before it and tests it on their last row, no bonus token after it; heads that score the newest
    candidate), `padded` (moved to the most candidates the target verifies at no more cost, by its measured curve,
    `CostPadded`; on drafters that draft a whole block in one pass, DFlash, beside plain or withdrawn stops)."""

    @property
    def pads(self) -> bool:
        """Whether padded stops run, which read the target's measured verification cost."""
        return "padded" in self.stops

    def __post_init__(self) -> None:
        where = "evaluate.acceptance_head"
        stops = self.stops if isinstance(self.stops, list) else [self.stops]
        if not all(stop in HEAD_STOPS for stop in stops) or len(set(stops)) != len(stops):
            raise ConfigError(
                f"{where}.stops={self.stops!r} must list distinct values of {list(HEAD_STOPS)} (e.g. [plain, padded])."
            )
        if not {"plain", "withdrawn"} & set(stops):
            raise ConfigError(
                f"{where}.stops={self.stops!r} pads stops but names no stop to pad: add plain (e.g. [plain, padded])."
            )
        object.__setattr__(self, "stops", list(stops))  # a single value read as a list of one, once, here
        for h in self.thresholds:
            check_number(where, "thresholds", h, 0.0, 1.0)
        check_count(where, "min_draft_length", self.min_draft_length)
        modes = self.score_newest if isinstance(self.score_newest, list) else [self.score_newest]
        if not modes or not all(isinstance(mode, bool) for mode in modes):
            raise ConfigError(
                f"{where}.score_newest={self.score_newest!r} must be false, true or [false, true]."
            )


@dataclass(frozen=True, kw_only=True)
class PromptLookupSettings:
    """`evaluate.prompt_lookup`: the training-free baseline, n-gram lookup in the context (vLLM's `ngram` method)."""

    min_ngram: int
    """Shortest suffix looked up (vLLM's prompt_lookup_min)."""
    max_ngram: int
    """Longest suffix looked up (vLLM's prompt_lookup_max); the longest that occurred before wins."""
    hybrid: bool
    """Also run every draft behind lookup (`<draft>+prompt_lookup`): lookup's block (up to the hybrid's own K) where
    the context offers a match, otherwise the draft's, at the K chosen for that draft alone."""
    choice: str
    """Which matches a hybrid drafts from lookup: `match` (every match, the fixed rule) or `fitted` (the matched
    suffix lengths where lookup accepts at least as many tokens as the draft on the selection split's answers,
    specdistill/drafts/prompt_lookup/choice.py), at the hybrid's chosen K and its draft's. It is fitted from greedy
    acceptance along those answers, also when the run samples."""
    choice_sequences: int
    """With `choice: fitted`, most selection-split sequences (prompt and answer) the choice is fitted on."""

    def __post_init__(self) -> None:
        where = "evaluate.prompt_lookup"
        check_count(where, "min_ngram", self.min_ngram)
        check_count(where, "max_ngram", self.max_ngram)
        check_count(where, "choice_sequences", self.choice_sequences)
        if self.choice not in ("match", "fitted"):
            raise ConfigError(f"{where}.choice={self.choice!r} must be match (every match) or fitted.")
        if self.min_ngram > self.max_ngram:
            raise ConfigError(
                f"{where}.min_ngram={self.min_ngram} is above {where}.max_ngram={self.max_ngram}: give "
                f"min_ngram <= max_ngram."
            )


@dataclass(frozen=True, kw_only=True)
class EvaluateSettings(StageSettings):
    """Drafts x draft-length policies against the autoregressive target (docs/METHODS.md sections 0 and 4)."""

    group: ClassVar[str] = "evaluate"
    drafts: dict[str, str]
    """Name -> draft export directory (a pipeline fills them); {}: models.draft."""
    heads: dict[str, str]
    """Draft name -> acceptance-head export directory (a pipeline fills them)."""
    policies: dict[str, dict[str, Any]]
    """The training-free policies (conf/policy/, each with its `_target_`), run on every draft."""
    fixed_lengths: list[int]
    """Fixed K candidates; the fastest on selection_split is reported."""
    acceptance_draft_length: int | None
    """Also report every draft's acceptance_rate at this fixed K (AdaSPEC's alpha); null: off."""
    acceptance_head: HeadPolicyGrid
    """The head policies' grid (a block: thresholds, min_draft_length, score_newest, stops)."""
    max_draft_length: int
    """The engine's bound for every policy."""
    prompt_lookup: PromptLookupSettings | None
    """The training-free baseline beside the drafts (its K chosen on selection_split like theirs); null: off."""
    test_task: dict[str, Any] | None
    """The task whose `split` is reported (a conf/task/ node, e.g. `/task@evaluate.test_task: humaneval_package`);
    null: the run's `task`. K and h are always chosen on the run's task (`selection_split`)."""
    split: str
    """The split reported."""
    num_prompts: int | None
    """Prompts of `split` decoded (null: all)."""
    selection_split: str
    """The split K and h are chosen on (never `split`'s test prompts)."""
    selection_prompts: int | None
    """Prompts of `selection_split` (null: all; 0: none)."""
    max_new_tokens: int
    """Most new tokens per generation."""
    max_length: int
    """Prompt tokenisation, as in training."""
    warmup: int
    """Untimed generations per configuration before timing."""
    repeats: int
    """Timed passes over the test prompts (configurations interleaved prompt by prompt)."""
    device: str
    """auto: cuda when available, else cpu."""
    offline_only: bool
    """Decode only the autoregressive target (greedy) and give every draft's offline tokens per target call at each K
    of `fixed_lengths` from teacher-forced passes over its outputs, without decoding any draft: the cheap points of a
    data-size study (equal to the decoded figure under greedy float32 decoding)."""
    cost_cache: str | None
    """Directory of the target's verification-cost curves, one file per model, hardware, dtype, thread count and
    context (`specdistill.decoding.cost.cached_verification_cost`); null: measured in every run."""

    def __post_init__(self) -> None:
        where = self.group
        object.__setattr__(
            self,
            "acceptance_head",
            build_block(HeadPolicyGrid, f"{where}.acceptance_head", self.acceptance_head),
        )
        if self.prompt_lookup is not None:
            lookup = build_block(PromptLookupSettings, f"{where}.prompt_lookup", self.prompt_lookup)
            object.__setattr__(self, "prompt_lookup", lookup)
            if "prompt_lookup" in (self.drafts or {}):
                raise ConfigError(
                    f"{where}.drafts names a draft prompt_lookup, the name of the prompt-lookup baseline: rename "
                    f"the draft, or turn the baseline off with {where}.prompt_lookup=null."
                )
        check_count(where, "max_draft_length", self.max_draft_length)
        if not self.fixed_lengths:
            raise ConfigError(
                f"{where}.fixed_lengths is empty: give the K grid, e.g. {where}.fixed_lengths=[2,4]."
            )
        for k in self.fixed_lengths:
            if not _is_int(k) or not 1 <= k <= self.max_draft_length:
                raise ConfigError(
                    f"{where}.fixed_lengths={self.fixed_lengths}: each K must be an integer in [1, "
                    f"{where}.max_draft_length={self.max_draft_length}]."
                )
        check_count(where, "acceptance_draft_length", self.acceptance_draft_length, optional=True)
        for key in ("num_prompts", "selection_prompts"):
            check_count(where, key, getattr(self, key), minimum=0, optional=True)
        for key in ("max_new_tokens", "max_length", "repeats"):
            check_count(where, key, getattr(self, key))
        check_count(where, "warmup", self.warmup, minimum=0)
