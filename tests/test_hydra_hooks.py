"""The command line's hooks into Hydra (runner.hydra_hooks): a run's config composed once, as Hydra would compose it
for the run."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hydra._internal.config_loader_impl import ConfigLoaderImpl

from conftest import TINY, run_main


def test_a_run_composes_its_config_once_as_hydra_would(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    """Hydra composed every run's config twice (once for hydra.mode, once to run); the one composition now gives
    what Hydra's run recorded: mode RUN, and the hydra.mode=RUN Hydra adds to the overrides where none is set."""
    compositions = []
    load = ConfigLoaderImpl.load_configuration

    def counted(self, *args, **kwargs):  # noqa: ANN001, ANN202 - Hydra's signature
        compositions.append(kwargs.get("run_mode"))
        return load(self, *args, **kwargs)

    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", counted)
    code, output = run_main([*TINY, "trainer.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}"],
                            monkeypatch, capsys)
    assert code == 0, output
    assert len(compositions) == 1
    recorded = yaml.safe_load((tmp_path / "run" / ".hydra" / "hydra.yaml").read_text())["hydra"]
    assert recorded["mode"] == "RUN"
    assert recorded["overrides"]["hydra"] == [f"hydra.run.dir={tmp_path / 'run'}", "hydra.mode=RUN"]
