"""One rank of a long ddp_explicit training that the failure test kills (or freezes) part-way.

Usage: ``python tests/strategies/failure_worker.py READY_DIR TIMEOUT_S`` with torchrun-style environment variables
(``tests/strategies/launch.py``). After a few steps each rank writes ``READY_DIR/rank<r>.pid``, then keeps
training (slowly) until it is stopped.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from mm_lightning.extras import ExplicitAllReduceDDPStrategy
from tests.strategies.tiny import TinyNet, tiny_loader


class ReportReady(pl.Callback):
    """Announces this rank's pid once training is under way; slows steps so the kill lands mid-training."""

    def __init__(self, ready_dir: Path) -> None:
        self.ready_dir = ready_dir

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 3:
            (self.ready_dir / f"rank{trainer.global_rank}.pid").write_text(str(os.getpid()))
        time.sleep(0.02)


def main(ready_dir: Path, timeout_s: float) -> None:
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=ExplicitAllReduceDDPStrategy(timeout_s=timeout_s),
        max_epochs=10_000, callbacks=[ReportReady(ready_dir)], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(TinyNet(), train_dataloaders=tiny_loader())


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]))
