"""The training loop, the last stage of the path CLI → validate → run folder → launch → worker → build → loop →
teardown: each worker hands it the objects it built, and a stage (`runner.stages`) runs it.

The map, in the order a step meets them:
  loop.py       `Loop`: the while-loops of fit, evaluate and predict; each step: step → log → validate → save
  step.py       `TrainStep`: one optimizer step over an accumulation window (token weights, clipping), with
                `NonFiniteGuard` (trainer.skip_nonfinite_loss) and `NonFiniteLossError`
  train_log.py  `TrainLog`: the log window's train metrics (trainer.log_every_n_steps steps), reduced while the
                next step trains, then logged; its open window goes into each checkpoint
  stop.py       `StopVote`: every process stops at the same step after a stop signal
  schedule.py   `Schedule`/`make_schedule`: when things happen, from trainer.*; `Progress`: where the run is
  state.py      what a checkpoint holds, resuming from one (rng, the same optimizer, this run's settings), saving
  progress.py   `make_console`: a `Bar` (tqdm, trainer.progress_bar) or `Lines` (the periodic log line); the
                start lines and one-line metric summaries
  results.py    the run's result: metrics.json (rank 0, atomic) and the final log line
"""

from runner.loop.loop import Loop
from runner.loop.schedule import Progress, Schedule, make_schedule
from runner.loop.step import NonFiniteGuard, NonFiniteLossError, TrainStep
from runner.loop.stop import StopVote

__all__ = ["Loop", "NonFiniteGuard", "NonFiniteLossError", "Progress", "Schedule", "StopVote", "TrainStep",
           "make_schedule"]
