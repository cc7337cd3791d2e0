"""Typed schemas of the primary config and of the runner's own config options, registered in Hydra's ConfigStore.

Each option file names its schema first in its defaults list (`/runner_schema_<name>@_here_`, a name in SCHEMAS), so a
value of the wrong type fails while Hydra composes, naming the key. A schema describes its class's
constructor keys; keys added with `+` are checked against the constructor's signature before any worker
starts (runner.checks.signatures), since Hydra adds them past any schema.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING


@dataclass
class TrainerConfig:
    devices: Any = "auto"  # int, -1 or 'auto' (all devices), or a list of device indices
    oversubscribe_cpu: bool = False  # true: start more CPU processes than 4 per usable core (refused otherwise)
    num_nodes: int = 1
    max_epochs: Optional[int] = None  # None: DEFAULT_EPOCHS, or no limit when max_steps is set; -1: no limit
    max_steps: int = -1  # -1: no limit
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = None
    log_every_n_steps: int = 20
    val_check_interval: Any = 1.0  # float: fraction of an epoch; int: every N optimizer steps
    limit_train_batches: Any = 1.0  # float: fraction of the batches; int: number of batches
    limit_val_batches: Any = 1.0
    limit_test_batches: Any = 1.0
    limit_predict_batches: Any = 1.0
    ckpt_every_n_steps: Optional[int] = None
    ckpt_path: Optional[str] = None  # a file, or 'last'
    trust_unchecked_checkpoint: bool = False  # load a ckpt_path named explicitly that carries no checksums
    seed: int = 0
    deterministic: bool = False
    fast_dev_run: Any = False  # true: 1 batch of each loop (train, val, test, predict), no checkpoints, loggers
    max_restarts: int = 0  # restart the job's workers this often after a failure, resuming from last.ckpt
    skip_nonfinite_loss: bool = False  # skip optimizer steps whose gradients are NaN/inf instead of stopping
    keep_last_k: Optional[int] = None  # keep only the newest k periodic step-000020.ckpt files
    compile: Any = False  # true: torch.compile the model with its loss; or torch.compile's arguments ({mode: ...})
    peak_tflops: Optional[float] = None  # one device's peak TFLOP/s for throughput/mfu; null: the known GPUs' table
    progress_bar: Any = "auto"  # auto: a bar when the console is a terminal; true: always; false: never
    num_threads: Any = "auto"  # CPU threads per process; auto: OMP_NUM_THREADS, else usable CPUs / local processes
    data_resume: str = "exact"  # exact: continue the data where the checkpoint stopped; restart: its epoch afresh
    # From ckpt_path: exact (its schedule goes on), new_schedule (the configured one from its step), weights (alone)
    resume: str = "exact"
    # False: a checkpoint's weights load without the keys the model or the checkpoint lacks, listed in one line
    strict_loading: bool = True


@dataclass
class RunnerConfig:
    """The primary config's schema: `trainer` is typed here, the runner's other groups by their options' schemas
    (below), the user's groups by their targets' signatures."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    strategy: Any = None
    accelerator: Any = None
    precision: Any = None
    checkpoint_io: Any = None
    cluster: Any = None
    model: Any = None
    data: Any = None
    optimizer: Any = None
    scheduler: Any = None
    task: Any = None
    callbacks: Any = None  # name -> callback spec (the `callbacks` group's options)
    metrics: Any = None  # name -> metric spec (or a list of specs)
    logger: Any = None
    stage: str = "fit"  # fit, validate, test or predict
    objective: str = "val/loss"  # the metric a sweep optimises
    direction: str = "minimize"
    # Free-form: the user's own keys, which the runner never reads (logged with the other settings).
    extras: Dict[str, Any] = field(default_factory=dict)
    tags: List[str] = field(default_factory=list)
    notes: Optional[str] = None


@dataclass
class Component:
    """A class built without settings of its own (accelerators, cluster environments, ...)."""

    _target_: str = MISSING


@dataclass
class AutoStrategyConfig:
    _target_: str = "runner.strategies.auto_strategy"
    start_method: str = "forkserver"  # forkserver | popen | spawn | fork


@dataclass
class _ProcessesConfig:
    """The keys DDPStrategy and FSDPStrategy share: how the processes start and meet."""

    _target_: str = MISSING
    process_group_backend: Optional[str] = None  # null: nccl on CUDA, gloo on CPU
    timeout: float = 1800  # seconds any collective may wait
    start_method: str = "forkserver"  # forkserver | popen | spawn | fork
    stall_timeout: Optional[float] = 300  # seconds a rank may make no progress; null or 0: not watched
    sync_batchnorm: bool = False  # batch-norm statistics over the global batch instead of each process's share


@dataclass
class DDPStrategyConfig(_ProcessesConfig):
    """DDPStrategy's own keys, then the DistributedDataParallel arguments the option file sets."""

    _target_: str = "runner.strategies.DDPStrategy"
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = True
    bucket_cap_mb: float = 25
    static_graph: bool = False


@dataclass
class FSDPStrategyConfig(_ProcessesConfig):
    """FSDPStrategy's keys: DDP's process settings, then how the model is sharded and checkpointed."""

    _target_: str = "runner.strategies.FSDPStrategy"
    shard: Any = "auto"  # auto, or module class names: [Block]
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    activation_checkpointing: List[str] = field(default_factory=list)  # module class names
    state_dict_type: str = "sharded"  # sharded | full


@dataclass
class FullPrecisionConfig:
    _target_: str = "runner.precision.Precision"
    tf32: bool = True  # on CUDA: float32 matmuls on TF32 tensor cores; false: full float32


@dataclass
class MixedPrecisionConfig:
    _target_: str = "runner.precision.MixedPrecision"
    precision: str = MISSING  # 16-mixed | bf16-mixed
    device: str = "auto"  # auto (the accelerator's device type), cpu or cuda


@dataclass
class HalfPrecisionConfig:
    _target_: str = "runner.precision.HalfPrecision"
    precision: str = MISSING  # 16-true | bf16-true


@dataclass
class ClassificationTaskConfig:
    _target_: str = "runner.tasks.ClassificationTask"
    top_k: List[int] = field(default_factory=lambda: [1])
    label_smoothing: float = 0.0
    target_key: str = "labels"


@dataclass
class LanguageModelTaskConfig:
    _target_: str = "runner.tasks.LanguageModelTask"
    ignore_index: int = -100
    label_smoothing: float = 0.0
    target_key: str = "labels"
    shift_labels: Any = "auto"  # auto | true | false: Any, since a str field would read `true` as "True"


@dataclass
class ModelTaskConfig:
    _target_: str = "runner.tasks.ModelTask"
    unit: str = "sample"
    preds_key: str = "logits"
    target_key: str = "labels"
    ignore_index: int = -100
    shift_labels: Any = "auto"  # auto | true | false


@dataclass
class RegressionTaskConfig:
    _target_: str = "runner.tasks.RegressionTask"
    loss: str = "mse"  # mse | l1 | huber
    huber_delta: float = 1.0
    target_key: str = "labels"


@dataclass
class TensorBoardLoggerConfig:
    _target_: str = "runner.loggers.TensorBoardLogger"
    subdir: str = "tensorboard"
    flush_secs: float = 30


@dataclass
class CSVLoggerConfig:
    _target_: str = "runner.loggers.CSVLogger"
    filename: str = "metrics.csv"


# The name each schema is stored under (outside any group, so --help lists only the real options).
SCHEMAS: dict[str, Any] = {
    "component": Component,
    "strategy_auto": AutoStrategyConfig,
    "strategy_ddp": DDPStrategyConfig,
    "strategy_fsdp": FSDPStrategyConfig,
    "precision_full": FullPrecisionConfig,
    "precision_mixed": MixedPrecisionConfig,
    "precision_half": HalfPrecisionConfig,
    "task_classification": ClassificationTaskConfig,
    "task_language_model": LanguageModelTaskConfig,
    "task_model": ModelTaskConfig,
    "task_regression": RegressionTaskConfig,
    "logger_tensorboard": TensorBoardLoggerConfig,
    "logger_csv": CSVLoggerConfig,
}
