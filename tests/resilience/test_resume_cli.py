"""Exact mid-epoch resume through the real CLI: SIGKILL a ``python -m mm_lightning fit`` run, resume it with
``--ckpt_path last`` and compare the final parameters with an uninterrupted run (<= 1e-6). The runs that are not
killed go through the same entry point in this process (``main``), which spares their interpreter start-ups."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import pytest
import torch

from mm_lightning.cli import main
from tests.conftest import tiny_demo_args
from tests.resilience.helpers import kill_once_saved

# The demo's defaults: a random caption per image and random crops, loaded in a DataLoader worker. The dataset
# seeds those draws per batch from the batch's indices and the module its own (hard negatives) from the batch's
# index, so they replay exactly after the resume (the control below: drawn from the process's generators instead,
# the resume is not exact).
DATA_EXTRA = ["--data.init_args.num_workers", "1"]
MAX_STEPS = 12  # the tiny demo has 64 training batches per epoch: every checkpoint here is mid-epoch


def cli_args(data_root: Path, run: Path, *extra: str) -> list[str]:
    """Tiny demo fit writing logs and checkpoints under ``run``, sharing the generated data in ``data_root``."""
    # last.ckpt every 2 steps, as a user sets it on the command line
    args = tiny_demo_args(run, "--checkpoint.every_n_train_steps", "2", max_steps=MAX_STEPS)
    args[args.index("--data.init_args.data_dir") + 1] = str(data_root / "demo")
    return ["fit", *args, *DATA_EXTRA, *extra]


def final_state(run: Path) -> dict[str, torch.Tensor]:
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == MAX_STEPS
    return checkpoint["state_dict"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_mid_epoch_then_resume_last_matches_uninterrupted_cli_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    full, killed = tmp_path / "full", tmp_path / "killed"
    assert main(cli_args(tmp_path, full)) == 0  # also generates the demo data the other runs reuse
    expected = final_state(full)

    killed_at = kill_once_saved(cli_args(tmp_path, killed), killed / "checkpoints", step=4)
    assert 4 <= killed_at < MAX_STEPS

    control = tmp_path / "control"
    shutil.copytree(killed, control)

    assert main(cli_args(tmp_path, killed, "--ckpt_path", "last")) == 0
    resumed = final_state(killed)
    assert resumed.keys() == expected.keys()
    worst = max((resumed[k].double() - expected[k].double()).abs().max().item() for k in expected)
    assert worst <= 1e-6, f"resumed from step {killed_at}: max parameter difference {worst:.3g}"

    # Control: the same resume with the module's draws taken from the process's generators ends elsewhere, and
    # the check sees it.
    monkeypatch.setattr(
        "mm_lightning.models.module.batch_draws", lambda trainer, device: contextlib.nullcontext()
    )
    assert main(cli_args(tmp_path, control, "--ckpt_path", "last")) == 0
    uncontrolled = final_state(control)
    assert max((uncontrolled[k].double() - expected[k].double()).abs().max().item() for k in expected) > 1e-6
