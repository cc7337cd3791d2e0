"""Lightning's APIs in the runner's terms: the one package that speaks Lightning, and never imports it.

A LightningDataModule gets a trainer view (`trainer_view`); a LightningModule's steps become the task (`task`), its
`configure_optimizers()` the optimizer and schedulers (`optimizers`), its `self.log` the run's metrics (`record`), its
hooks and the Lightning callbacks' hooks one runner callback (`hooks`, attached by `attach`); what is not run is
refused before launch (`checks`). Lightning objects are told by their classes' names (`detect`): the user's code
imports lightning, the runner never does.
"""

from runner.lightning.detect import is_lightning_config

# The package's face imports nothing heavy (no torch): the command line reads runner.lightning.stock before torch.
__all__ = ["is_lightning_config"]
