"""A callback that saves each rank's final model state, so tests can compare ranks (checkpoints are rank 0's)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
from typing_extensions import override


class SaveRankState(pl.Callback):
    """Writes ``out_dir/rank<global_rank>.pt`` (the LightningModule's state dict) when training ends.

    Args:
        out_dir: where to write; created if missing.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        state = {"state_dict": pl_module.state_dict(), "global_step": trainer.global_step,
                 "world_size": trainer.world_size, "num_nodes": trainer.num_nodes, "node_rank": trainer.node_rank}  # fmt: skip
        torch.save(state, self.out_dir / f"rank{trainer.global_rank}.pt")
