"""User code that fails on purpose, named by `data._target_=faulty_user_code.<Name>` or
`+callbacks.<name>._target_=faulty_user_code.<Name>`: a sample that raises, a loader worker that is killed, a callback
that raises, for the tests of how user-code failures are reported."""

from __future__ import annotations

import os
import signal

from torch.utils.data import Dataset, get_worker_info

from runner.data import SyntheticClassification


class _Failing(Dataset):
    """`dataset`'s samples, until its `at`-th read in this process: then `what` ('raise', or 'kill' this loader
    worker with SIGKILL; in the main process 'kill' raises, so that only a worker dies)."""

    def __init__(self, dataset: Dataset, at: int, what: str) -> None:
        self.dataset, self.at, self.what, self.reads = dataset, at, what, 0

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        self.reads += 1
        if self.reads == self.at:
            if self.what == "kill" and get_worker_info() is not None:
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError(f"injected failure reading sample {index}")
        return self.dataset[index]


class BadSample(SyntheticClassification):
    """Synthetic data whose training set fails at its `at`-th read in a process (past what the pre-launch check
    reads): `what` is 'raise' or 'kill'."""

    def __init__(self, at: int = 40, what: str = "raise", **kwargs) -> None:
        super().__init__(**kwargs)
        self.train_dataset = _Failing(self.train_dataset, at, what)


class RaiseIn:
    """A callback that raises RuntimeError in its `hook` (on_fit_start or on_train_batch_end)."""

    def __init__(self, hook: str = "on_fit_start") -> None:
        setattr(self, hook, self._raise)

    def _raise(self, *args) -> None:
        raise RuntimeError("injected failure in a callback")
