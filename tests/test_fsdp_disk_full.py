"""A sharded save on a full disk: one line naming the checkpoint and the full disk, the run fails, and the previous
checkpoint stays whole (a real size-limited tmpfs, mounted in a user namespace: no root needed)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _dist import clean_environ
from runner.checkpoint_io import sharded

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("fsdp")]

RUN = ("accelerator=cpu", "cluster=local", "strategy=fsdp", "trainer.devices=2", "data.batch_size=16",
       "data.num_samples=256", "data.val_samples=64", "data.num_features=8", "model.hidden=128", "logger=none",
       "optimizer=adamw", "trainer.max_epochs=-1", "trainer.ckpt_every_n_steps=1000")

# In a mount namespace of its own: a 4 MiB tmpfs; a run of 2 steps saves (about 300 KiB); the disk is then filled
# to 160 KiB of free space (enough to start a run, not to save again) and the run resumed for 2 more steps.
SCRIPT = """
set -e
mount -t tmpfs -o size=4m tmpfs {mount}
{python} -m runner {run} hydra.run.dir={mount}/run trainer.max_steps=2 > {mount}/../first.out 2>&1
free=$(df -k --output=avail {mount} | tail -1)
dd if=/dev/zero of={mount}/filler bs=1k count=$((free - 160)) 2>/dev/null
set +e
{python} -m runner {run} hydra.run.dir={mount}/run trainer.max_steps=4 trainer.ckpt_path=last
echo "exit=$?"
cp -r {mount}/run/checkpoints {mount}/../kept
"""


def test_a_full_disk_fails_the_save_in_one_line_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode:
        pytest.skip("this system allows no user namespace to mount a small tmpfs in")
    mount = tmp_path / "small"
    mount.mkdir()
    script = SCRIPT.format(mount=mount, python=shlex.quote(sys.executable), run=" ".join(RUN))
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300,
                          env=clean_environ(), cwd=Path(__file__).resolve().parents[1])
    console = done.stdout + done.stderr
    assert "exit=1" in done.stdout, console
    assert "Traceback" not in console, console
    errors = [line for line in done.stderr.splitlines() if line and not line.startswith("[")]  # not the log lines
    # Whichever rank reported first names the other after the message.
    first, other = ("0", "1") if errors and errors[0].startswith("error: rank 0: ") else ("1", "0")
    assert errors[0].startswith(f"error: rank {first}: "), console
    # The other rank met the same error, unless the launcher stopped it first (then it is no cause of its own).
    assert errors[1:] in ([], [f"then rank {other}: the same"]), console
    assert re.fullmatch(
        re.escape(f"error: rank {first}: cannot write sharded checkpoint {mount}/run/checkpoints/last.ckpt: the disk is "
                  "full or a quota was reached (") + r"0\.\d MiB" + re.escape(
            f" free in {mount}/run/checkpoints): free some space there or save elsewhere; the previous checkpoint "
            "there is left intact"), errors[0]), console
    kept = tmp_path / "kept"
    assert sorted(p.name for p in kept.iterdir()) == ["last.ckpt"]  # the failed save's folder is gone
    checkpoint = sharded.read(kept / "last.ckpt")
    assert checkpoint["step"] == 2 and all(torch.isfinite(t).all() for t in checkpoint["model"].values())
