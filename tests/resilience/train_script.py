"""A tiny training run for the kill / signal tests: ``python -m tests.resilience.train_script --root DIR ...``.

It uses the resilience callbacks the CLI installs, a shuffled stateful loader and dropout, sleeps a little per
step so that a test can signal it mid-epoch, writes ``DIR/step<N>`` markers after each step and
``DIR/final.pt`` (the parameters) when training ends.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from typing_extensions import override

from mm_lightning.checkpoints import AtomicCheckpointIO
from mm_lightning.extras import ExactResume, PreemptionCheckpoint
from mm_lightning.extras.nan_guard import NaNGuard
from tests.resilience.helpers import TinyModule, flat_params


class StepMarkers(Callback):
    """Slows each step down and leaves a ``step<N>`` file after it, so a test can time its signal."""

    def __init__(self, root: Path, sleep: float, val_sleep: float = 0.0) -> None:
        self.root = root
        self.sleep, self.val_sleep = sleep, val_sleep

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        time.sleep(self.sleep)
        (self.root / f"step{trainer.global_step}").touch()

    @override
    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.sanity_checking:
            return
        (self.root / f"validating{trainer.global_step}").touch()
        time.sleep(self.val_sleep)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        torch.save(
            {"params": flat_params(pl_module), "global_step": trainer.global_step}, self.root / "final.pt"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=2, help="last.ckpt every N steps")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds per step")
    parser.add_argument("--ckpt-path", default=None)
    parser.add_argument("--no-exact-resume", action="store_true", help="leave out ExactResume (a control)")
    parser.add_argument("--val-every", type=int, default=0, help="validate every N steps (0: no validation)")
    parser.add_argument("--val-batches", type=int, default=20, help="validation batches")
    parser.add_argument("--val-sleep", type=float, default=0.0, help="seconds per validation batch")
    args = parser.parse_args(argv)
    args.root.mkdir(parents=True, exist_ok=True)

    seed_everything(7)
    data = torch.randn(56, 8, generator=torch.Generator().manual_seed(0))
    # 7 batches per epoch: checkpoints every 2 steps fall in the middle of epochs.
    loader = StatefulDataLoader(TensorDataset(data, data.sum(1)), batch_size=8, shuffle=True)
    val_data = torch.randn(8 * args.val_batches, 8, generator=torch.Generator().manual_seed(1))
    val_loader = StatefulDataLoader(TensorDataset(val_data, val_data.sum(1)), batch_size=8)
    validation: dict[str, Any] = (
        {"val_check_interval": args.val_every, "num_sanity_val_steps": 0}
        if args.val_every
        else {"limit_val_batches": 0, "num_sanity_val_steps": 0}
    )
    trainer = Trainer(
        accelerator="cpu",
        max_steps=args.max_steps,
        **validation,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[AtomicCheckpointIO()],
        callbacks=[
            ModelCheckpoint(
                dirpath=args.root / "ckpts", every_n_train_steps=args.every, save_top_k=0, save_last=True
            ),
            PreemptionCheckpoint(),
            NaNGuard(),
            StepMarkers(args.root, args.sleep, args.val_sleep),
            *(
                [] if args.no_exact_resume else [ExactResume(reseed_every_batch=True)]
            ),  # dropout outside batch_draws
        ],
    )
    trainer.fit(TinyModule(dropout=0.3), loader, val_loader, ckpt_path=args.ckpt_path)


if __name__ == "__main__":
    main()
