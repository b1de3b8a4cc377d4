"""Exact mid-epoch resume from shards through the real CLI: SIGKILL a ``fit`` on demo shards, resume it with
``--ckpt_path last``; the final weights equal an uninterrupted run's (the sampler's position, in the
checkpoint, makes the resumed run read exactly the samples it had not seen; test_sampler.py holds the
loader-level control: a loader without that state starts the epoch over). The runs that are not killed go through
the same entry point in this process (``main``), which spares their interpreter start-ups."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mm_lightning.cli import main
from mm_lightning.extras import DemoShardDataModule
from tests.resilience.helpers import kill_once_saved
from tests.shards.helpers import shard_demo_args

MAX_STEPS = 8  # 1032 samples in shards of 100, batch 16: 64 batches per epoch, every checkpoint is mid-epoch


def cli_args(demo: Path, run: Path, *extra: str) -> list[str]:
    args = shard_demo_args(run, max_steps=MAX_STEPS, callbacks={"checkpoint": {"every_n_train_steps": 2}})
    args[args.index("--data.init_args.data_dir") + 1] = str(demo)
    return [
        "fit", *args,
        "--data.init_args.samples_per_shard", "100",
        "--data.init_args.num_workers", "1",
        "--data.init_args.shuffle_shards", "2",
        "--trainer.deterministic", "true",
        "--trainer.limit_val_batches", "0",  # last.ckpt is written every 2 steps without validation
        *extra,
    ]  # fmt: skip


def final_state(run: Path) -> dict[str, torch.Tensor]:
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == MAX_STEPS
    return checkpoint["state_dict"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_mid_epoch_then_resume_reads_exactly_the_unseen_shard_samples(tmp_path: Path) -> None:
    demo = tmp_path / "demo"
    generator = {"render_size": 32, "train_renders": 1, "num_val": 24, "num_test": 24}
    DemoShardDataModule(str(demo), samples_per_shard=100, **generator).prepare_data()  # shared by the runs
    full, killed = tmp_path / "full", tmp_path / "killed"
    assert main(cli_args(demo, full)) == 0
    killed_at = kill_once_saved(cli_args(demo, killed), killed / "checkpoints", step=2)
    assert 2 <= killed_at < MAX_STEPS

    assert main(cli_args(demo, killed, "--ckpt_path", "last")) == 0
    expected, resumed = final_state(full), final_state(killed)
    assert resumed.keys() == expected.keys()
    worst = max((resumed[k].double() - expected[k].double()).abs().max().item() for k in expected)
    assert worst <= 1e-6, f"resumed from step {killed_at}: max parameter difference {worst:.3g}"
