"""The manual's commands and snippets, run: README.md and docs/*.md cannot drift from the code.

Every fenced block is treated by its language (a block of another language, or of none, fails the test):
- bash: one command a line (`\\` continues it, `&&` chains commands, `#` starts a comment, `VAR=value` words before
  a command set its environment). `python -m runner ...` and `runner ...` run in this process through
  runner.cli.main with `stage=check` appended (unless they check already). `torchrun ... -m runner ...` and
  `srun ... python -m runner ...` the same, in the environment the launcher gives rank 0 of the process count its
  options name. `python -m runner.export ...` runs as it is, against a trained run at outputs/2026-01-01/12-00-00.
  Commands that cannot run here are named in NOT_RUN, each with why; a command no rule knows fails the test.
- yaml: parsed. With a title (`yaml title="my_conf/model/mynet.yaml"`) it is a file of the page's folder, and a
  command of the page must compose it (`--config-dir my_conf ... model=mynet`), or the test fails.
- python: with a title, a module of the page's folder, imported; without one, run as it is in the page's folder.
- text: shown, not run (output, layouts); a runner command in one fails the test.
A marker on the line before a block changes its treatment: `<!-- check: skip (why) -->` runs none of it (pytest
reports it skipped, with why); `<!-- check: gpu -->` checks its runner commands as on a CUDA machine
(`accelerator=cuda` before their own overrides: stage=check counts the CUDA devices this machine lacks);
`<!-- check: fails -->` expects each runner command to be refused: exit 1 with an `error:` line, no traceback.

Each page runs in a folder of its own (its titled files, and a copy of one trained run), from which its commands
import the page's code as a user's shell would; a command that appears again on a page with the same files is
checked once. A failing command fails with the page, the line, the command and what it printed. The site itself is
built with `mkdocs build --strict`: a broken link or anchor fails it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import pytest
import yaml
from hydra.core.global_hydra import GlobalHydra

import runner
from conftest import REPO, run_main

pytestmark = pytest.mark.xdist_group("docs")  # the pages share one trained run

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LANGUAGES = ("bash", "yaml", "python", "text")
# The run every page's folder holds, for commands that name a checkpoint or a run folder.
RUN = "outputs/2026-01-01/12-00-00"
RUN_SETTINGS = ["callbacks=model_checkpoint", "trainer.max_steps=4", "trainer.val_check_interval=2",
                "trainer.limit_val_batches=2", "logger=csv"]

# Commands the test does not run, by their first word, each with why.
NOT_RUN = {
    "pip": "installs packages (.ci/run installs the project as the README says)",
    "pytest": "the test suite itself (.ci/run runs the README's command)",
    "mkdocs": "builds this manual: test_the_site_builds builds it with --strict",
    "eval": "installs shell completion (tests/test_cli.py completes through what it installs)",
    "cd": "moves the shell: the commands after it run in the page's folder",
    "sbatch": "submits a SLURM batch job: there is no cluster here",
    "mlflow": "MLflow's own UI and server (tests/test_tracking.py runs a server)",
    "wandb": "W&B's own command line (it needs an account)",
    "tensorboard": "TensorBoard's viewer",
    "benchmarks/gpu_check.sh": "needs a CUDA GPU: the GPU tests and benchmarks, run by hand",
}
BENCHMARK = "a benchmark: timings belong in benchmarks/, run by hand, never in tests"


def not_run_reason(words: list[str]) -> Optional[str]:
    """Why a command is not run, or None for one the test runs (or knows no rule for)."""
    if words[0] in ("python", "python3") and words[1:2] and words[1].startswith("benchmarks/"):
        return BENCHMARK
    return NOT_RUN.get(words[0])


FENCE = re.compile(r"^(```+)\s*(\S*)\s*(.*)$")
TITLE = re.compile(r'^title="([^"]+)"$')
MARKER = re.compile(r"^<!-- check: (.*) -->$")


def _name(page: Path) -> str:
    return str(page.relative_to(REPO)) if page.is_relative_to(REPO) else page.name


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    title: Optional[str]
    marker: Optional[str]
    text: str

    @property
    def where(self) -> str:
        return f"{_name(self.page)}:{self.line}"

    @property
    def skipped(self) -> bool:
        return (self.marker or "").startswith("skip")


def blocks_of(page: Path) -> list[Block]:
    """The fenced blocks of a page, each with its title and the marker on the line before it."""
    lines, blocks, at = page.read_text().splitlines(), [], 0
    while at < len(lines):
        opening = FENCE.match(lines[at])
        if not opening:
            at += 1
            continue
        end = next((i for i in range(at + 1, len(lines)) if lines[i].startswith(opening.group(1))), None)
        if end is None:
            raise ValueError(f"{_name(page)}:{at + 1}: a code block that never closes")
        title = TITLE.match(opening.group(3))
        before = MARKER.match(lines[at - 1]) if at else None
        blocks.append(Block(page, at + 1, opening.group(2), title.group(1) if title else None,
                            before.group(1) if before else None, "\n".join(lines[at + 1:end])))
        at = end + 1
    return blocks


BLOCKS = [block for page in PAGES for block in blocks_of(page)]


@dataclass(frozen=True)
class Command:
    line: int
    env: dict[str, str]
    words: list[str]
    text: str


def commands_of(block: Block) -> list[Command]:
    """A bash block's commands: lines joined at a trailing backslash, split at `&&`, comments dropped."""
    commands, pending, first = [], "", 0
    for number, line in enumerate(block.text.splitlines(), start=block.line + 1):
        if not pending:
            first = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        words, pending = shlex.split(pending + line, comments=True), ""
        while words:
            part, words = (words[:words.index("&&")], words[words.index("&&") + 1:]) if "&&" in words else (words, [])
            env = {}
            while part and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", part[0]):
                key, value = part.pop(0).split("=", 1)
                env[key] = value
            if part:
                commands.append(Command(first, env, part, shlex.join(part)))
    return commands


def option_files(block: Block) -> Iterator[tuple[str, str, str]]:
    """(config dir, group, option) of the option files a block's runner commands compose."""
    for command in commands_of(block):
        args = runner_args(command.words) or []
        dirs = [a.split("=", 1)[1] for a in args if a.startswith("--config-dir=")]
        dirs += [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--config-dir"]
        dirs += re.findall(r"file://([^\],]+)", " ".join(a for a in args if a.startswith("hydra.searchpath=")))
        for arg in args:
            key, _, value = arg.partition("=")
            for option in value.strip("[]").split(","):
                yield from ((folder.rstrip("/"), key.lstrip("+~"), option) for folder in dirs)


def runner_args(words: list[str]) -> Optional[list[str]]:
    """The overrides of `python -m runner ...` or `runner ...`; None for another command."""
    if words[0] == "runner":
        return words[1:]
    if words[0] in ("python", "python3") and words[1:3] == ["-m", "runner"]:
        return words[3:]
    return None


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding one short run of the default config, with best.ckpt: what the pages' commands that name
    `trainer.ckpt_path=last|best` or a run folder find, as a user's would after a first run."""
    root = tmp_path_factory.mktemp("docs-run")
    runner.fit(runner.compose(RUN_SETTINGS), run_dir=root / RUN)
    GlobalHydra.instance().clear()
    return root


@pytest.fixture(scope="module")
def page_folders(tmp_path_factory: pytest.TempPathFactory, trained_run: Path) -> dict[Path, Path]:
    """Each page's folder: a copy of the trained run and the page's titled files."""
    folders = {}
    root = tmp_path_factory.mktemp("docs-pages")
    for page in PAGES:
        folder = root / str(page.relative_to(REPO)).replace("/", "-")
        shutil.copytree(trained_run, folder)
        for block in blocks_of(page):
            if block.title and not block.skipped:
                path = folder / block.title
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(block.text + "\n")
        folders[page] = folder
    return folders


@pytest.fixture
def in_page_folder(page_folders: dict[Path, Path], request: pytest.FixtureRequest,
                   monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The test runs in its page's folder, which it imports code from; the code of other pages' folders is
    forgotten (each page has its own `mypackage`)."""
    block: Block = request.node.callspec.params["block"]
    folder = page_folders[block.page]
    _forget_modules_under(folder.parent)
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    _forget_modules_under(folder.parent)


def _forget_modules_under(root: Path) -> None:
    for name, module in list(sys.modules.items()):
        spec = getattr(module, "__spec__", None)
        places = [spec.origin, *(spec.submodule_search_locations or [])] if spec is not None else []
        if any(str(place or "").startswith(str(root)) for place in places):
            del sys.modules[name]
    importlib.invalidate_caches()


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_block(block: Block, in_page_folder: Path, monkeypatch: pytest.MonkeyPatch,
               capsys: pytest.CaptureFixture) -> None:
    problems = problems_of(block, in_page_folder, monkeypatch, capsys)
    assert not problems, "\n\n".join(problems)


def problems_of(block: Block, folder: Path, monkeypatch: pytest.MonkeyPatch,
                capsys: pytest.CaptureFixture) -> list[str]:
    """What is wrong with a block, run in its page's `folder` as its language says; a skipped block skips the test."""
    if block.marker not in (None, "gpu", "fails"):
        skipped = re.fullmatch(r"skip \((.+)\)", block.marker)
        if not skipped:
            return [f"{block.where}: marker `{block.marker}`: use `skip (why)`, `gpu` or `fails`"]
        pytest.skip(f"{block.where}: {skipped.group(1)}")
    if block.language not in LANGUAGES:
        return [f"{block.where}: a block in `{block.language or 'no language'}`: give it one of {', '.join(LANGUAGES)}"]
    if block.title is not None and block.language not in ("yaml", "python"):
        return [f"{block.where}: a title names a file of yaml or python, not of {block.language}"]
    if block.language == "bash":
        return [p for c in commands_of(block) if (p := _run_command(block, c, folder, monkeypatch, capsys))]
    if block.language == "yaml":
        return _check_yaml(block)
    if block.language == "python":
        _run_python(block, capsys)
        return []
    shown = [line for line in block.text.splitlines() if line.startswith(("python -m runner", "runner "))]
    return [f"{block.where}: runner commands in a text block, never run: make it bash: {shown}"] if shown else []


def _run_command(block: Block, command: Command, folder: Path, monkeypatch: pytest.MonkeyPatch,
                 capsys: pytest.CaptureFixture) -> Optional[str]:
    """None when the command passes its check (or a NOT_RUN rule names it), else what it printed."""
    words, where = command.words, f"{_name(block.page)}:{command.line}: {command.text}"
    if not_run_reason(words):
        return None
    if words[0] in ("python", "python3") and words[1:3] == ["-m", "runner.export"]:
        return _run_export(words[3:], where, capsys)
    launched = _runner_command(words)
    if launched is None:
        return f"{where}\n  no rule for this command: add one to tests/test_docs.py, or mark its block"
    if isinstance(launched, str):
        return f"{where}\n  {launched}"
    args, env = launched
    args = [_inside(arg, folder) for arg in (["accelerator=cuda", *args] if block.marker == "gpu" else args)]
    if not any(a.lstrip("+") in ("stage=check", "stage=check_data") for a in args):
        args.append("stage=check")
    env = {**command.env, **env}
    key = (tuple(args), tuple(sorted(env.items())), _files_of(block.page))
    if key not in _CHECKED:  # the same command on a page with the same files is checked once
        _CHECKED[key] = _check(args, env, monkeypatch, capsys)
    code, out = _CHECKED[key]
    ran = f"{where}\n  `{shlex.join(args)}` exited {code}"
    if block.marker == "fails":
        refused = code == 1 and "error:" in out and "Traceback" not in out
        return None if refused else f"{ran}, not refused in one line:\n{_indented(out)}"
    return f"{ran}:\n{_indented(out)}" if code else None


_CHECKED: dict[tuple, tuple[int, str]] = {}


def _files_of(page: Path) -> tuple:
    return tuple((b.title, b.text) for b in blocks_of(page) if b.title and not b.skipped)


def _check(args: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
           capsys: pytest.CaptureFixture) -> tuple[int, str]:
    """`python -m runner *args` in this process, in `env`: the exit code and what it printed."""
    with monkeypatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        GlobalHydra.instance().clear()
        return run_main(args, patch, capsys)


def _runner_command(words: list[str]) -> tuple[list[str], dict[str, str]] | str | None:
    """The runner's overrides and the environment the command gives them; a problem; None for no runner command."""
    if words[0] == "torchrun":
        return _launched_by_torchrun(words)
    if words[0] == "srun":
        return _launched_by_srun(words)
    args = runner_args(words)
    return None if args is None else (args, {})


def _inside(arg: str, folder: Path) -> str:
    """An absolute run or sweep folder (a cluster's shared one) is taken inside the page's folder."""
    key, sep, value = arg.partition("=")
    if sep and key in ("hydra.run.dir", "hydra.sweep.dir") and value.startswith("/"):
        return f"{key}={folder}{value}"
    return arg


def _options(words: list[str], until: int) -> dict[str, str]:
    """A launcher's `--key=value` options (`--flag` alone: an empty value), `_` and `-` alike in keys."""
    pairs = (w[2:].partition("=") for w in words[1:until] if w.startswith("--"))
    return {key.replace("_", "-"): value for key, _, value in pairs}


def _launched_by_torchrun(words: list[str]) -> tuple[list[str], dict[str, str]] | str:
    """The runner's overrides of `torchrun [--opt=value ...] -m runner ...`, and rank 0's environment."""
    if "-m" not in words or words[words.index("-m") + 1:words.index("-m") + 2] != ["runner"]:
        return "torchrun without `-m runner`"
    at = words.index("-m")
    options = _options(words, at)
    try:
        per_node, nodes = int(options["nproc-per-node"]), int(options.get("nnodes", "1"))
    except (KeyError, ValueError):
        return "torchrun needs --nproc-per-node=<number> (and --nnodes=<number> across nodes)"
    env = {"RANK": 0, "LOCAL_RANK": 0, "GROUP_RANK": 0, "WORLD_SIZE": per_node * nodes, "LOCAL_WORLD_SIZE": per_node,
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500, "TORCHELASTIC_RUN_ID": "docs"}
    return words[at + 2:], {key: str(value) for key, value in env.items()}


def _launched_by_srun(words: list[str]) -> tuple[list[str], dict[str, str]] | str:
    """The runner's overrides of `srun --nodes=N --ntasks-per-node=G python -m runner ...`, and its task 0's
    environment."""
    at = next((i for i, w in enumerate(words) if w in ("python", "python3")), None)
    args = runner_args(words[at:]) if at is not None else None
    if args is None:
        return "srun without `python -m runner`"
    options = _options(words, at)
    try:
        nodes, per_node = int(options["nodes"]), int(options["ntasks-per-node"])
    except (KeyError, ValueError):
        return "srun needs --nodes=<number> --ntasks-per-node=<number>"
    env = {"SLURM_NTASKS": nodes * per_node, "SLURM_NNODES": nodes, "SLURM_PROCID": 0, "SLURM_LOCALID": 0,
           "SLURM_NODEID": 0, "SLURM_JOB_ID": 1, "SLURM_STEP_ID": 0, "SLURM_JOB_NAME": "docs"}
    return args, {key: str(value) for key, value in env.items()}


def _run_export(args: list[str], where: str, capsys: pytest.CaptureFixture) -> Optional[str]:
    from runner import export

    try:
        code = export.main(args)
    except SystemExit as stop:  # argparse's refusal
        code = stop.code if isinstance(stop.code, int) else 1
    captured = capsys.readouterr()
    return f"{where}\n  exited {code}:\n{_indented(captured.out + captured.err)}" if code else None


def _check_yaml(block: Block) -> list[str]:
    try:
        yaml.safe_load(block.text)
    except yaml.YAMLError as error:
        return [f"{block.where}: not valid YAML: {error}"]
    if block.title is None:
        return []
    parts = Path(block.title).parts
    if len(parts) < 3 or not block.title.endswith(".yaml"):
        return [f"{block.where}: title {block.title}: an option file is <config dir>/<group>/<option>.yaml"]
    folder, group, option = parts[0], "/".join(parts[1:-1]), Path(parts[-1]).stem
    composing = [b for b in blocks_of(block.page) if b.language == "bash" and not b.skipped]
    if any((folder, group, option) in set(option_files(b)) for b in composing):
        return []
    return [f"{block.where}: no command on this page composes {block.title}: add one "
            f"(python -m runner --config-dir {folder} {group}={option})"]


def _run_python(block: Block, capsys: pytest.CaptureFixture) -> None:
    if block.title is not None:
        assert block.title.endswith(".py"), f"{block.where}: a python title names a .py file"
        importlib.import_module(block.title[:-3].replace("/", "."))
        return
    exec(compile(block.text, block.where, "exec"), {"__name__": "__docs__"})  # noqa: S102 - the page's own code
    capsys.readouterr()


def _indented(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(f"    {line}" for line in lines[-15:])


DRIFTED = """
```bash
python -m runner trainer.max_stepz=3
foo --bar
srun python -m runner strategy=ddp
```

<!-- check: fails -->
```bash
python -m runner --cfg job
```

```yaml title="my_conf/model/unused.yaml"
_target_: torch.nn.Identity
```

```text
python -m runner experiment=shapes
```

```
pip install runner
```
"""


def test_the_checker_finds_what_drifted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture) -> None:
    """A misspelt key, a command no rule knows, a launcher without its sizes, a refusal that passes, an option file
    nothing composes, a command shown but never run and a block of no language: each is a problem, named."""
    page = tmp_path / "drifted.md"
    page.write_text(DRIFTED)
    monkeypatch.chdir(tmp_path)
    problems = [problems_of(block, tmp_path, monkeypatch, capsys) for block in blocks_of(page)]
    assert [len(found) for found in problems] == [3, 1, 1, 1, 1]
    (key, rule, srun), (passed,), (unused,), (shown,), (language,) = problems
    assert "drifted.md:3: python -m runner trainer.max_stepz=3" in key and "did you mean trainer.max_steps?" in key
    assert "no rule for this command" in rule and "srun needs --nodes=<number>" in srun
    assert "exited 0, not refused in one line" in passed
    assert "no command on this page composes my_conf/model/unused.yaml" in unused
    assert "never run: make it bash" in shown and "no language" in language


def test_the_readme_is_a_front_door() -> None:
    """The README stays short, and every link in it leads to a file of the repository."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200, "README.md is over 200 lines: move the details into docs/"
    for target in re.findall(r"\]\(([^)#\s]+)[^)]*\)", text):
        assert target.startswith("http") or (REPO / target).exists(), f"README.md links to {target}, which is missing"


def test_the_site_builds(tmp_path: Path) -> None:
    """`mkdocs build --strict`: a warning (a broken link or anchor, a page left out of the nav) fails it."""
    missing = [m for m in ("mkdocs", "material") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (pip install -e '.[dev]' installs them)")
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                            str(REPO / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                           cwd=REPO, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert build.returncode == 0, build.stdout + build.stderr
