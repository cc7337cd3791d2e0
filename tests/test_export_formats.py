"""`python -m runner.export` writes what the model's ecosystem reads: a safetensors file that safetensors loads, a
save_pretrained folder that transformers' Auto classes load, a checkpoint that LightningModule.load_from_checkpoint
loads (weights_only); what a run cannot be written as is refused in one line naming what it can."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import runner
from runner.build import build_model
from runner.checkpoint_io import TorchCheckpointIO
from runner.checkpoint_io.formats import LIGHTNING_TASK
from runner.checkpoint_io.model_record import record_model
from runner.export import main as export_main

from conftest import REPO, TINY, compose_config, load_checkpoint

TESTS = Path(__file__).resolve().parent
BASE = tuple(o for o in TINY if not o.startswith("logger.")) + ("logger=none", "trainer.max_steps=2")
RUN = tuple(o for o in BASE if not o.startswith(("data.", "model.")))
LM_DATA = ("data.num_samples=32", "data.val_samples=8", "data.max_len=12", "trainer.val_check_interval=2")


@pytest.fixture(autouse=True)
def _workers_import_the_fixtures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    monkeypatch.syspath_prepend(str(TESTS))


class Tied(nn.Module):
    """An embedding and a head that is the same tensor (GPT-2's tie), registered embedding first."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.mid = nn.Linear(3, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("count", torch.tensor(7, dtype=torch.int64))


def _fake_run(folder: Path, model: dict, task: str, state: dict, record: dict | None = None) -> Path:
    """A run folder as a run leaves it: .hydra/resolved.yaml, checkpoints/last.ckpt (checksummed), model.json."""
    from omegaconf import OmegaConf

    (folder / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create({"model": model}), folder / ".hydra" / "resolved.yaml")
    TorchCheckpointIO().save_checkpoint({"model": state, "optimizer": {}, "step": 2, "epoch": 0, "task": task},
                                        folder / "checkpoints" / "last.ckpt")
    if record is not None:
        (folder / "model.json").write_text(json.dumps(record))
    return folder


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_safetensors_loads_back_equal_with_tied_weights_once(tmp_path: Path, dtype: torch.dtype,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file, load_model

    model = Tied().to(dtype)
    run = _fake_run(tmp_path / "run", {"_target_": "somewhere.Tied"}, "runner.tasks.supervised.ClassificationTask",
                    model.state_dict())
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "safetensors", None)  # the runner writes the format itself
        assert export_main([str(run), str(tmp_path / "w.safetensors")]) == 0
    loaded = load_file(tmp_path / "w.safetensors")
    saved = load_checkpoint(run)["model"]
    assert set(loaded) == set(saved) - {"head.weight"}  # one copy of the tie, under the embedding's name
    for name, value in loaded.items():
        assert value.dtype == saved[name].dtype and torch.equal(value, saved[name]), name
    with safe_open(tmp_path / "w.safetensors", "pt") as f:
        assert json.loads(f.metadata()["aliases"]) == {"head.weight": "embed.weight"}
    fresh = Tied().to(dtype)
    load_model(fresh, tmp_path / "w.safetensors")  # strict: the tie is restored by the model's own sharing
    assert torch.equal(fresh.head.weight, saved["embed.weight"]) and fresh.head.weight is fresh.embed.weight


def test_the_file_is_byte_for_byte_what_safetensors_writes(tmp_path: Path) -> None:
    """Header layout, dtype codes, order (wider dtypes first) and alignment padding as the reference writer's."""
    from safetensors.torch import save_file as reference

    from runner.checkpoint_io.safetensors_io import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(3, 4, generator=g), "h": torch.randn(5, generator=g).bfloat16(),
               "ids": torch.arange(6), "flag": torch.tensor(True), "t": torch.randn(4, 3, generator=g).t()}
    save_file(tensors, tmp_path / "ours.safetensors", {"format": "pt"})
    reference({k: v.contiguous() for k, v in tensors.items()}, tmp_path / "theirs.safetensors", {"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()


@pytest.mark.parametrize("name,auto", [("tiny_gpt2", "AutoModelForCausalLM"), ("tiny_bert", "AutoModelForMaskedLM")])
def test_a_recorded_pretrained_model_exports_a_folder_from_pretrained_loads(tmp_path: Path, name: str,
                                                                             auto: str) -> None:
    import transformers

    cfg = compose_config([*RUN, f"experiment={name}", *LM_DATA])
    runner.fit(cfg, run_dir=tmp_path / "run")
    record_model(build_model(cfg), tmp_path / "run")  # what the run writes when it starts
    assert export_main([str(tmp_path / "run"), str(tmp_path / "hf"), "--format", "hf"]) == 0
    loaded = getattr(transformers, auto).from_pretrained(tmp_path / "hf")
    trained = build_model(cfg)
    trained.load_state_dict(load_checkpoint(tmp_path / "run")["model"])
    assert type(loaded) is type(trained)
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight  # still tied
    state = loaded.state_dict()
    for key, value in trained.state_dict().items():
        assert torch.equal(state[key], value), key
    ids = torch.tensor([[2, 5, 9, 3, 7]])
    torch.testing.assert_close(loaded.eval()(input_ids=ids).logits, trained.eval()(input_ids=ids).logits,
                               rtol=0, atol=0)


def test_a_config_given_as_data_exports_without_a_record(tmp_path: Path) -> None:
    """model.config with its model_type (Hydra builds the config, then the model from it): config.json is that data."""
    import transformers

    import re

    conf = tmp_path / "conf" / "experiment"
    conf.mkdir(parents=True)
    given = ("model:\n  _target_: transformers.GPT2LMHeadModel\n  config:\n    _target_: transformers.GPT2Config\n"
             "    model_type: gpt2\n    vocab_size: ${data.vocab_size}\n    n_positions: ${data.max_len}\n"
             "    n_embd: 16\n    n_layer: 1\n    n_head: 2\n    use_cache: false\n")
    preset = (REPO / "conf" / "experiment" / "tiny_gpt2.yaml").read_text()
    (conf / "gpt2_config.yaml").write_text(re.sub(r"^model:\n(  .*\n)+", given, preset, flags=re.M))
    cfg = runner.compose([*RUN, "experiment=gpt2_config", *LM_DATA], config_dir=str(tmp_path / "conf"))
    runner.fit(cfg, run_dir=tmp_path / "run")
    record = json.loads((tmp_path / "run" / "model.json").read_text())  # written by the run, at its start
    assert record["kind"] == "transformers" and record["hf_config"]["n_embd"] == 16
    (tmp_path / "run" / "model.json").unlink()  # the config alone must be enough here
    assert export_main([str(tmp_path / "run"), str(tmp_path / "hf"), "--format", "hf"]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert (loaded.config.n_embd, loaded.config.n_layer) == (16, 1)
    state = loaded.state_dict()
    for key, value in load_checkpoint(tmp_path / "run")["model"].items():
        assert torch.equal(state[key], value), key


@pytest.mark.parametrize("cls,settings", [("LitClassifier", ("+model.lr=0.2",)), ("LitPlain", ("+model.lr=0.3",))])
def test_a_lightning_run_exports_a_checkpoint_load_from_checkpoint_reads(tmp_path: Path, cls: str,
                                                                          settings: tuple) -> None:
    """LitClassifier records its settings (save_hyperparameters); LitPlain does not, and gets them from the config."""
    import lightning_modules

    cfg = compose_config([*BASE, "model.in_features=8", "model.num_classes=4",
                          f"model._target_=lightning_modules.{cls}", *settings])
    runner.fit(cfg, run_dir=tmp_path / "run")
    if cls == "LitClassifier":
        assert record_model(build_model(cfg), tmp_path / "run", lightning=True)  # what the run writes at its start
    target = tmp_path / "lit.ckpt"
    assert export_main([str(tmp_path / "run"), str(target), "--format", "lightning"]) == 0
    loaded = getattr(lightning_modules, cls).load_from_checkpoint(target)  # Lightning's default: weights_only
    saved = load_checkpoint(tmp_path / "run")
    assert loaded.state_dict().keys() == saved["model"].keys()
    for key, value in saved["model"].items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert (loaded.lr if cls == "LitPlain" else loaded.hparams.lr) == float(settings[0].split("=")[1])
    trained = build_model(cfg)
    trained.load_state_dict(saved["model"])
    x = torch.randn(5, 8)
    torch.testing.assert_close(loaded.eval()(x) if cls == "LitClassifier" else loaded.net(x),
                               trained.eval()(x) if cls == "LitClassifier" else trained.net(x), rtol=0, atol=0)
    written = torch.load(target, weights_only=True)
    assert (written["global_step"], written["epoch"]) == (saved["step"], saved["epoch"])
    # What save_hyperparameters() recorded (model.json) adds the defaults the config does not spell out.
    assert ("patience" in written["hyper_parameters"]) == (cls == "LitClassifier")


def test_a_model_the_record_cannot_describe_never_fails_the_run(tmp_path: Path) -> None:
    class Config:
        def to_json_string(self, use_diff: bool = True) -> str:
            raise TypeError("a value JSON cannot hold")

    class Pretrained(nn.Module):  # named as transformers names its base, so that it is taken for one
        config = Config()

    base = type("PreTrainedModel", (nn.Module,), {"__module__": "transformers.modeling_utils"})
    model = type("Broken", (base, Pretrained), {})()
    assert record_model(model, tmp_path) is False
    assert not (tmp_path / "model.json").exists()


@pytest.mark.parametrize("fmt,task,record,says", [
    ("hf", LIGHTNING_TASK, None, "needs a transformers PreTrainedModel; this run's model is a LightningModule"),
    ("hf", "runner.tasks.supervised.ClassificationTask", {"class": "runner.models.MLP", "kind": "torch"},
     "needs a transformers PreTrainedModel; this run's model is runner.models.MLP (a torch model)"),
    ("hf", "runner.tasks.supervised.ClassificationTask", None, "needs the run's HuggingFace config"),
    ("lightning", "runner.tasks.supervised.ClassificationTask", None, "needs a run whose model is a LightningModule"),
])
def test_a_format_the_run_cannot_be_written_in_is_one_line_naming_those_it_can(
        tmp_path: Path, capsys: pytest.CaptureFixture, fmt: str, task: str, record: dict | None, says: str) -> None:
    run = _fake_run(tmp_path / "run", {"_target_": "runner.models.MLP", "hidden": 4}, task,
                    {"w": torch.ones(2)}, record)
    assert export_main([str(run), str(tmp_path / "out"), "--format", fmt]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err and "it can be written as torch" in err, err
    assert ("lightning" in err.split("it can be written as")[1]) == (task == LIGHTNING_TASK)
    assert not (tmp_path / "out").exists()


def test_without_lightning_installed_the_lightning_format_says_what_to_install(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    run = _fake_run(tmp_path / "run", {"_target_": "somewhere.Lit"}, LIGHTNING_TASK, {"w": torch.ones(2)})
    assert export_main([str(run), str(tmp_path / "lit.ckpt"), "--format", "lightning"]) == 1
    assert "neither lightning nor pytorch-lightning is installed here: pip install lightning" in capsys.readouterr().err
    assert not (tmp_path / "lit.ckpt").exists()


def test_the_lightning_task_is_told_by_the_name_checkpoints_record() -> None:
    """A run without model.json is told to be a Lightning run by its checkpoint's `task`: the name must follow the
    class."""
    from runner.checkpoint_io.trust import task_name
    from runner.lightning.task import LightningTask

    assert task_name(LightningTask) == LIGHTNING_TASK


def test_the_module_a_run_names_is_never_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's config names a module that would run code on import: the lightning export reads its settings as
    data (plain keys kept, an object's node left out and named for the user to pass)."""
    (tmp_path / "planted.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    run = _fake_run(tmp_path / "run", {"_target_": "planted.Lit", "width": 3, "net": {"_target_": "planted.Net"}},
                    LIGHTNING_TASK, {"w": torch.ones(2)})
    assert export_main([str(run), str(tmp_path / "lit.ckpt"), "--format", "lightning"]) == 0
    assert not (tmp_path / "ran").exists() and "planted" not in sys.modules
    written = torch.load(tmp_path / "lit.ckpt", weights_only=True)
    assert written["hyper_parameters"] == {"width": 3}


def test_a_tampered_record_adds_no_code_to_a_lightning_export(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """model.json's hyper_parameters were copied whole: an `_instantiator` (Lightning imports and calls it at load,
    releases before 2.6.6 without asking) or a jsonargparse `class_path` reached the exported checkpoint."""
    record = {"class": "somewhere.Lit", "kind": "lightning", "objects": ["_instantiator"],
              "hyper_parameters": {"lr": 0.1, "_instantiator": "os.system", "net": {"class_path": "evil.Net"}}}
    run = _fake_run(tmp_path / "run", {"_target_": "somewhere.Lit"}, LIGHTNING_TASK, {"w": torch.ones(2)}, record)
    assert export_main([str(run), str(tmp_path / "lit.ckpt"), "--format", "lightning"]) == 0
    written = torch.load(tmp_path / "lit.ckpt", weights_only=True)
    assert written["hyper_parameters"] == {"lr": 0.1}
    out = capsys.readouterr().out
    assert "left out of hyper_parameters: _instantiator, net (they name code a loader would call)" in out, out
    assert "_instantiator=..." not in out  # nothing for the user to pass either


MLP_WEIGHTS = {"net.0.weight": torch.ones(16, 8), "net.0.bias": torch.ones(16), "net.2.weight": torch.ones(4, 16)}
GPT2 = {"model_type": "gpt2", "vocab_size": 50, "n_embd": 16, "n_layer": 2, "architectures": ["GPT2LMHeadModel"]}


@pytest.mark.parametrize("fmt,task,record,says", [
    ("hf", "runner.tasks.supervised.ClassificationTask",
     {"class": "transformers.GPT2LMHeadModel", "kind": "transformers", "hf_config": GPT2},
     "does not fit the checkpoint's weights: vocab_size=50 is no size or layer of theirs (net.0.weight (16, 8)"),
    ("lightning", "runner.tasks.supervised.ClassificationTask", {"class": "somewhere.Lit", "kind": "lightning"},
     "says the model is somewhere.Lit (kind lightning), but the checkpoint was trained with task "
     "runner.tasks.supervised.ClassificationTask"),
], ids=["mlp-called-transformers", "mlp-called-lightning"])
def test_a_record_that_misdescribes_the_weights_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture, fmt: str,
                                                           task: str, record: dict, says: str) -> None:
    """A model.json that called an MLP a transformers model was believed: config.json said GPT-2 over an MLP's
    weights, which from_pretrained then fills with random ones."""
    run = _fake_run(tmp_path / "run", {"_target_": "runner.models.MLP"}, task, MLP_WEIGHTS, record)
    assert export_main([str(run), str(tmp_path / "out"), "--format", fmt]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err
    assert "the record does not describe this checkpoint" in err and not (tmp_path / "out").exists()
