"""Every check a config passes before any worker starts, run by the one `validate`.

CLI → compose → plan → [validate] → run folder → launch → worker → build → loop → teardown. Each module holds one
concern, in the order validate runs them (from signatures on, each reads the plan of what the run will build,
runner.plan: the job's, or one validate makes when called alone):
  keys        the config's shape: removed groups, keys no schema has (compose runs these too)
  static      plain values in range and of their type, every `_target_` importable
  signatures  each component's settings against its constructor's signature
  components  CPU processes, devices, backend, precision, a trainable model, compile, the task's settings
  optimizers  several named optimizers: each trainable parameter in exactly one, a strategy that runs them
  schedule    the data's contract and first batches, the optimizer and the scheduler over the run's steps
  callbacks   callbacks, metrics (and top_k), loggers
  fsdp        strategy=fsdp's settings against the model
  checkpoint  trainer.ckpt_path against the config
  run_folder  the job's run folder and its loggers' folders can take files
A new check goes in the module of its concern, and is called from validate here. The checks read the run's pieces from
the plan, and build trial objects through runner.build; runner.build never imports them. `stage=check` (dry_run)
runs validate, then passes the first batch of data.batch_size samples through the model or a LightningModule's steps
(trial), and reports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from omegaconf import DictConfig

from runner import collector
from runner.checks import static
from runner.checks.keys import check_keys
from runner.config import CONFIG_DIR, ConfigError

if TYPE_CHECKING:
    from runner.plan import Plan


def validate(cfg: DictConfig, ckpt_path: Optional[str] = None) -> Plan:
    """Raise ConfigError listing every problem of `cfg` (and of the checkpoint file `ckpt_path`, when given); nothing
    is started before this passes. Returns the plan the checks read."""
    from runner.plan import Plan

    return validate_plan(Plan(cfg, checkpoint=ckpt_path))


def validate_plan(plan: Plan) -> Plan:
    """`validate` for the plan a job made: its config, its checkpoint and its run folder."""
    # Imported here: the command line reads runner.checks.keys at start-up, before torch is needed.
    from runner.checks import callbacks, checkpoint, components, fsdp, optimizers, run_folder, schedule, signatures

    cfg, ckpt_path = plan.cfg, plan.ckpt_path  # `last`/`best` looked for first: where none is, that is the one line
    problems = check_keys(cfg, CONFIG_DIR)
    if problems:  # the checks below read the groups
        raise ConfigError(problems)
    problems = [*static.check_trainer(cfg.trainer), *static.check_stage(cfg), *static.check_logger(cfg),
                *static.check_objective(cfg), *static.check_data(cfg), *static.check_targets(cfg)]
    collector.resume()  # the modules the config names are imported: what lives on is made (runner.collector)
    if problems:  # the checks below build objects, which needs importable, well-typed settings
        raise ConfigError(problems)
    problems += signatures.check_signatures(plan)
    if problems:  # building with keys a constructor does not take would only repeat them
        raise ConfigError(problems)
    problems += components.check_cpu_processes(plan)
    if problems:  # the strategy the checks below build holds one device per process
        raise ConfigError(problems)
    # Each builds what it checks, as the workers will; every problem is reported, in this order.
    for check in (components.check_components, components.check_half_optimizer, components.check_backend,
                  components.check_trainable, optimizers.check_optimizer_parts, schedule.check_data_and_schedule,
                  components.check_task, callbacks.check_top_k, callbacks.check_metrics, callbacks.check_callbacks,
                  callbacks.check_loggers, components.check_compile, fsdp.check_fsdp):
        problems += check(plan)
    if ckpt_path is not None and not problems:
        problems += checkpoint.check_checkpoint(plan)
    problems += run_folder.check_writable(plan)
    if problems:
        raise ConfigError(problems)
    return plan
