"""`python -m runner` in a subprocess: the default run's folder, Hydra's own flags, and bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, Optional

import pytest
import torch

from conftest import clean_environ, load_checkpoint, read_events
from hook_fixtures import events

# What Hydra itself writes into a run folder before the job starts.
HYDRA_FILES = {".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", "runner.log"}


def run_cli(*args: str, cwd: Path, env: Optional[dict] = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runner", *args], cwd=cwd, env={**clean_environ(), **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def files_under(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} if folder.exists() else set()


def test_default_command_trains_and_fills_the_run_folder(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    start = time.monotonic()
    result = run_cli(f"hydra.run.dir={run_dir}", cwd=tmp_path)
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stderr
    assert elapsed < 60, f"the default run took {elapsed:.0f}s"
    assert "Traceback" not in result.stderr
    assert "trainer:" in (run_dir / ".hydra" / "config.yaml").read_text()

    events = read_events(run_dir)
    losses = [event.value for event in events.Scalars("train/loss")]
    assert len(losses) >= 5 and losses[-1] < 0.7 * losses[0], f"train/loss did not fall: {losses}"
    assert [e.step for e in events.Scalars("train/loss")] == sorted(e.step for e in events.Scalars("train/loss"))
    assert {"val/loss", "val/acc", "lr", "throughput/samples_per_s"} <= set(events.Tags()["scalars"])
    assert "_hparams_/session_start_info" in events.PluginTagToContent("hparams")

    checkpoint = load_checkpoint(run_dir)
    assert {"model", "optimizer", "step", "epoch"} <= checkpoint.keys()
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["step"] == checkpoint["step"] > 0
    assert 0 < metrics["val/loss"] < losses[0]
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize(("flag", "expected"), [
    (("--help",), "python -m runner"),
    (("--cfg", "job"), "trainer:\n  devices: auto"),
    (("--info",), "Config search path"),
])
def test_hydra_flags(tmp_path: Path, flag: tuple[str, ...], expected: str) -> None:
    result = run_cli(*flag, cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    assert expected in result.stdout
    assert list(tmp_path.iterdir()) == [], "printing the config must not create a run folder"


IMPORTED_AFTER_FLAG = """
import sys
from runner.cli import main
sys.argv = ["runner", *sys.argv[1:]]
try:
    main()
except SystemExit:
    pass
print(sorted({m.split(".")[0] for m in sys.modules} & {"torch", "tensorboard"}))
"""


@pytest.mark.parametrize("flag", [("--cfg", "job"), ("--help",)])
def test_printing_flags_import_neither_torch_nor_tensorboard(tmp_path: Path, flag: tuple[str, ...]) -> None:
    """They answer in well under a second because they never load torch (about a second alone)."""
    result = subprocess.run([sys.executable, "-c", IMPORTED_AFTER_FLAG, *flag], cwd=tmp_path, env=clean_environ(),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


# Bad input: (id, overrides, a text the message must contain). {tmp} is this module's scratch folder.
BAD_INPUT = [
    ("unknown-strategy", ["strategy=nonexistent"], "strategy=nonexistent is not an option of strategy: auto,"),
    ("devices-not-a-number", ["trainer.devices=abc"], "trainer.devices=abc"),
    ("misspelled-key", ["trainer.devicez=2"], "trainer.devicez"),
    ("numeric-precision", ["precision=17"], "precision=17 is not an option of precision: 16-mixed,"),
    ("zero-batch", ["data.batch_size=0"], "data.batch_size=0"),
    ("missing-checkpoint", ["trainer.ckpt_path=/missing.ckpt"], "trainer.ckpt_path=/missing.ckpt"),
    ("corrupt-checkpoint", ["trainer.ckpt_path={tmp}/corrupt.ckpt"], "trainer.ckpt_path={tmp}/corrupt.ckpt"),
    ("cuda-without-gpu", ["accelerator=cuda"], "accelerator=cuda"),
    ("fp16-mixed-on-cpu", ["precision=16-mixed"], "precision=16-mixed"),
    ("model-not-importable", ["model._target_=nope.Model"], "model._target_=nope.Model"),
    ("zero-devices", ["trainer.devices=0"], "trainer.devices=0"),
    ("two-nodes-locally", ["trainer.num_nodes=2"], "trainer.num_nodes=2"),
]


# Under pytest -n, the module's tests stay in one test process, which runs this fixture once for all.
pytestmark = pytest.mark.xdist_group("cli")


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Path, Future]]]:
    """Start every bad-input run at once (each is mostly interpreter start-up); each test waits for its own."""
    tmp = tmp_path_factory.mktemp("bad_input")
    (tmp / "corrupt.ckpt").write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8).numpy().tobytes())
    # A machine without a GPU, whatever this one has.
    env = {"CUDA_VISIBLE_DEVICES": ""}
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        runs = {}
        for name, overrides, _ in BAD_INPUT:
            run_dir = tmp / name
            args = [f"hydra.run.dir={run_dir}", *(o.format(tmp=tmp) for o in overrides)]
            runs[name] = (run_dir, pool.submit(run_cli, *args, cwd=tmp, env=env, timeout=60))
        yield {name: (run_dir, future) for name, (run_dir, future) in runs.items()}


@pytest.mark.parametrize(("name", "overrides", "expected"), BAD_INPUT, ids=[case[0] for case in BAD_INPUT])
def test_bad_input_exits_1_with_a_short_message(bad_runs: dict, name: str, overrides: list[str],
                                                expected: str) -> None:
    run_dir, future = bad_runs[name]
    result = future.result()
    expected = expected.format(tmp=run_dir.parent)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    assert expected in result.stderr, result.stderr
    assert len(result.stderr.splitlines()) <= 25, result.stderr
    assert files_under(run_dir) <= HYDRA_FILES, "nothing beyond Hydra's own files may be written"


COMPLETE = """
source "$1"
for line in "python -m runner stra" "python -m runner strategy=" "python -m runner strategy=ddp trainer.dev"; do
    COMP_LINE="$line"; read -r -a COMP_WORDS <<< "$line"; COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 ))
    COMP_POINT=${#line}; COMPREPLY=()
    _runner_python_m_completion
    echo "${COMPREPLY[*]}"
done
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_bash_completion_completes_python_m_runner(tmp_path: Path) -> None:
    script = run_cli("-sc", "install=bash", cwd=tmp_path, timeout=60)
    assert script.returncode == 0, script.stderr
    (tmp_path / "complete.sh").write_text(script.stdout)
    env = {**clean_environ(), "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "-c", COMPLETE, "complete", str(tmp_path / "complete.sh")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["strategy. strategy=", "strategy=auto strategy=ddp strategy=dp strategy=fsdp strategy=single",
                                        "trainer.devices="]


def test_the_runner_script_completes_and_imports_from_the_current_folder(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "runner"
    query = subprocess.run([str(script), "-sc", "query=bash"], cwd=tmp_path,
                           env={**clean_environ(), "COMP_LINE": "runner stra"}, capture_output=True, text=True,
                           timeout=60)
    assert query.stdout.split() == ["strategy.", "strategy="], query.stderr
    (tmp_path / "mymodels.py").write_text("from runner.models import MLP\n\nclass Tiny(MLP):\n    pass\n")
    run_dir = tmp_path / "run"
    result = subprocess.run([str(script), "model._target_=mymodels.Tiny", "model.hidden=8", "trainer.max_steps=2",
                             "data.num_samples=128", "data.val_samples=32", f"hydra.run.dir={run_dir}",
                             "+callbacks.rec._target_=hook_fixtures.Recorder", f"+callbacks.rec.folder={tmp_path}"],
                            cwd=tmp_path, env={**clean_environ(), "PYTHONPATH": str(Path(__file__).parent)},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "mymodels.Tiny" in (run_dir / ".hydra" / "resolved.yaml").read_text()
    # the script is the command as `python -m runner` is: Python's collector paused while it imports (runner.collector)
    end = events(tmp_path)[-1]
    assert not end["collecting_at_import"] and end["collecting"] and end["frozen"] > 0, end


@pytest.mark.parametrize("sweep", [False, True], ids=["run", "sweep-job"])
def test_a_link_planted_as_runner_log_is_refused_not_written_through(tmp_path: Path, sweep: bool) -> None:
    """Hydra's job logging opens runner.log as the workers open theirs: a link planted there is one line, exit 1,
    and the file it points to stays as it was."""
    target = tmp_path / "precious.txt"
    target.write_text("precious\n")
    folder = tmp_path / "sweep" if sweep else tmp_path / "run"
    log = folder / "0" / "runner.log" if sweep else folder / "runner.log"
    log.parent.mkdir(parents=True)
    log.symlink_to(target)
    where = ["-m", f"hydra.sweep.dir={folder}"] if sweep else [f"hydra.run.dir={folder}"]
    result = run_cli(*where, "trainer.max_steps=1", "logger=none", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert (f"{log} is a symbolic link (to {target}); the runner never writes a log through a link: remove it, or "
            "choose another hydra.run.dir") in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert target.read_text() == "precious\n"
