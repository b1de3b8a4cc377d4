"""A tiny LightningModule and data for the resilience tests (seconds per run on CPU)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from mm_lightning.checkpoints import AtomicCheckpointIO
from mm_lightning.extras.nan_guard import NaNGuard
from mm_lightning.models.optim import warmup_cosine
from tests import preloaded


class TinyModule(LightningModule):
    """Two small "encoders" and a head on random features; can poison its loss on chosen (rank, step) pairs.

    Args:
        poison: ``{rank: [global_step, ...]}`` where the loss is made NaN.
        poison_graph: NaN through the graph (gradients become NaN) instead of through a constant term
            (loss NaN, gradients finite).
        dropout: Dropout probability (exercises RNG state on resume).
        fused: use AdamW's fused kernel.
    """

    def __init__(
        self,
        poison: dict[int, list[int]] | None = None,
        poison_graph: bool = False,
        dropout: float = 0.0,
        fused: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.image_encoder = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(dropout)
        )
        self.text_encoder = torch.nn.Linear(8, 16)
        self.head = torch.nn.Linear(32, 1)

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        features = torch.cat([self.image_encoder(x), self.text_encoder(x.flip(1))], dim=1)
        loss = torch.nn.functional.mse_loss(self.head(features).squeeze(1), y)
        if self.global_step in (self.hparams.poison or {}).get(self.global_rank, []):
            loss = loss * float("nan") if self.hparams.poison_graph else loss + torch.tensor(float("nan"))
        self.log("train/loss", loss, batch_size=x.shape[0])
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        features = torch.cat([self.image_encoder(x), self.text_encoder(x.flip(1))], dim=1)
        self.log(
            "val/loss", torch.nn.functional.mse_loss(self.head(features).squeeze(1), y), batch_size=x.shape[0]
        )

    @override
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1, fused=self.hparams.fused)
        # Like MultimodalModule's warmup/cosine: the run's length is asked for once training runs (asked here,
        # Lightning would set up the train loader before a checkpoint's position in it is known).
        trainer = self.trainer
        scheduler = warmup_cosine(optimizer, 0, lambda: trainer.estimated_stepping_batches, 0.0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def random_loader(n: int = 64, batch_size: int = 8, shuffle: bool = False, seed: int = 0) -> DataLoader:
    """A loader over fixed random regression data."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1)), batch_size=batch_size, shuffle=shuffle)


def flat_params(module: torch.nn.Module) -> torch.Tensor:
    """All parameters concatenated into one vector (a copy)."""
    return torch.cat([p.detach().flatten() for p in module.parameters()]).clone()


class SaveParamsAtEnd(Callback):
    """Writes each rank's final parameters and the guard's counters to ``out_dir/rank{r}.pt``.

    Args:
        out_dir: Folder for the per-rank files.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        guard = next((c for c in trainer.callbacks if isinstance(c, NaNGuard)), None)
        torch.save(
            {
                "params": flat_params(pl_module),
                "skipped_steps": None if guard is None else guard.skipped_steps,
                "global_step": trainer.global_step,
                "logged_skipped": trainer.callback_metrics.get("train/skipped_steps"),
            },
            Path(self.out_dir) / f"rank{trainer.global_rank}.pt",
        )


class UnsyncedNaNGuard(NaNGuard):
    """Control for the tests: decides on this rank's flags only (what the guard must not do)."""

    @override
    def _gather_flags(self, trainer: Trainer, local: torch.Tensor) -> torch.Tensor:
        return local


def _ddp_worker(rank: int, world_size: int, port: int, fn: Callable[[str], None], out_dir: str) -> None:
    # Lightning treats a process with LOCAL_RANK set as launched externally (like torchrun) and only joins the
    # process group, so each rank can catch its own exception instead of the launcher killing its peers.
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        LOCAL_RANK=str(rank),
        RANK=str(rank),
    )
    fn(out_dir)


def run_on_two_ranks(fn: Callable[[str], None], out_dir: Path) -> None:
    """Run ``fn(out_dir)`` in 2 spawned processes that form a gloo group (``fn`` builds a 2-device Trainer).

    Args:
        fn: A picklable (module-level) function.
        out_dir: Folder the ranks write their results to.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.start_processes(
        _ddp_worker, args=(2, port, fn, str(out_dir)), nprocs=2, join=True, start_method="spawn"
    )


def fit_tiny(module: TinyModule, callbacks: list[Callback], steps: int = 5, **trainer_kwargs: Any) -> Trainer:
    """Fit ``module`` on :func:`random_loader` for ``steps`` steps, without logger or default checkpoints.

    Saves go through :class:`AtomicCheckpointIO`, as in the CLI.
    """
    has_checkpoint = any(isinstance(c, ModelCheckpoint) for c in callbacks)
    trainer_kwargs.setdefault("plugins", [AtomicCheckpointIO()])  # as the CLI installs it
    trainer_kwargs.setdefault("accelerator", "cpu")
    trainer = Trainer(
        max_steps=steps,
        logger=False,
        enable_checkpointing=has_checkpoint,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **trainer_kwargs,
    )
    trainer.fit(module, random_loader())
    return trainer


class KeepEpochEndCheckpoint(Callback):
    """Copies ``last.ckpt`` as the first epoch left it to ``<to>/checkpoints/last.ckpt``: what a run killed right
    after that epoch's end would have left, taken from an uninterrupted run.

    Args:
        to: The run folder that receives the copy.
    """

    def __init__(self, to: str) -> None:
        self.to = Path(to) / "checkpoints"

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # At the second epoch's start last.ckpt holds the end of the first (written after its validation).
        if trainer.current_epoch == 1 and trainer.is_global_zero:
            self.to.mkdir(parents=True, exist_ok=True)
            latest = next(c for c in trainer.checkpoint_callbacks if c.monitor is None)  # keeps last.ckpt
            shutil.copyfile(latest.best_model_path, self.to / "last.ckpt")


class RecordSamples(Callback):
    """Appends each training batch's sample indices to ``<out>/rank<R>.jsonl`` (one line per batch, flushed, so a
    SIGKILL keeps what was written) and, with ``kill_at_step``, SIGKILLs every rank when that step begins: after
    the checkpoint of the step before is written, before the batch trains.

    Under torchrun the kill happens in the first attempt only (a restarted one resumes).

    Args:
        out: folder of the logs.
        kill_at_step: global step whose batch start kills the process.
        leave_rank: rank whose launcher (its parent: torchrun's agent) is killed too, as a node that leaves.
    """

    def __init__(self, out: str, kill_at_step: int | None = None, leave_rank: int | None = None) -> None:
        self.out, self.kill_at_step, self.leave_rank = Path(out), kill_at_step, leave_rank

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if trainer.global_step == self.kill_at_step and first_attempt:
            trainer.strategy.barrier()  # every rank is past the checkpoint's save
            if trainer.global_rank == self.leave_rank:
                os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        self.out.mkdir(parents=True, exist_ok=True)
        row = {"epoch": trainer.current_epoch, "step": trainer.global_step, "index": batch["index"].tolist()}
        with open(self.out / f"rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


def recorded_samples(out: Path, steps: range | None = None) -> list[int]:
    """Every index :class:`RecordSamples` wrote under ``out`` (all ranks), of the global steps in ``steps``."""
    seen = []
    for log in sorted(out.glob("rank*.jsonl")):
        for line in log.read_text().splitlines():
            row = json.loads(line)
            if steps is None or row["step"] in steps:
                seen += row["index"]
    return seen


def last_step(checkpoint_dir: Path) -> int:
    """Global step of ``last.ckpt`` (-1 if none yet, or while it is being replaced)."""
    path = checkpoint_dir / "last.ckpt"
    try:
        return torch.load(path, weights_only=True)["global_step"] if path.exists() else -1
    except (RuntimeError, EOFError):
        return -1


def kill_once_saved(args: list[str], checkpoint_dir: Path, step: int, timeout: float = 300) -> int:
    """Runs ``python -m mm_lightning *args`` until ``last.ckpt`` in ``checkpoint_dir`` is at ``step`` or later, then
    SIGKILLs it; the step it was killed at."""
    errors = checkpoint_dir.parent / "killed.log"
    errors.parent.mkdir(parents=True, exist_ok=True)
    with errors.open("w") as sink:
        process = preloaded.popen(
            [sys.executable, "-m", "mm_lightning", *args], stdout=subprocess.DEVNULL, stderr=sink
        )
    deadline = time.monotonic() + timeout
    try:
        while last_step(checkpoint_dir) < step:
            assert process.poll() is None, errors.read_text()[-5000:]
            assert time.monotonic() < deadline, f"no checkpoint at step {step} within {timeout:g} s"
            time.sleep(0.05)
    finally:
        process.kill()  # at the step, or left running by a failed check
        process.wait(timeout=30)
    return last_step(checkpoint_dir)
