"""Data: the built-in synthetic tasks, the global order every step's batch is taken from (map-style sets, a
user's sampler, streams), the loaders that give each process its share, and data modules' prepare_data/setup.

Path: CLI → validate → run folder → launch → worker → [build: the data object, set up] → [loop: its loaders]."""

from runner.data.batches import Batch, TensorPairDataset, collate
from runner.data.loaders import FIRST_SAMPLES, TrainBatches, first_batch_problem, train_loader, val_loader
from runner.data.loaders import close as close_loaders
from runner.data.modules import STAGE_SPLITS, LoaderData, is_data_module, prepare, ready
from runner.data.order import EvalSampler, TrainSampler
from runner.data.synthetic import InputsDataset, SyntheticClassification, SyntheticRegression

__all__ = ["Batch", "TensorPairDataset", "collate", "FIRST_SAMPLES", "TrainBatches", "first_batch_problem",
           "train_loader", "val_loader", "close_loaders", "STAGE_SPLITS", "LoaderData", "is_data_module", "prepare",
           "ready", "EvalSampler", "TrainSampler", "InputsDataset", "SyntheticClassification", "SyntheticRegression"]
