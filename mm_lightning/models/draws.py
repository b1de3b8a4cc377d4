"""The random draws of a training step (dropout, hard negatives), seeded so that they depend only on the run's
seed, the batch's index, the rows they are drawn for and the part of the step that draws them: a resumed run
draws what an uninterrupted one did, and a part run on another process (each tower on its own, say) draws
what it would have drawn beside the others."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from lightning.pytorch import Trainer

from mm_lightning.data.seeding import derive_seed, global_seed

# the parts of a step that draw, in the order they run
STEP_PARTS = ("image", "text", "loss")


@dataclass(frozen=True)
class BatchSeed:
    """What the draws of the running training batch are seeded from."""

    base: int
    batch: int
    rank: int
    device: torch.device

    def seed(self, values: tuple[int, ...]) -> None:
        seed = derive_seed(self.base, (self.batch, *values))
        torch.default_generator.manual_seed(seed)
        if self.device.type != "cpu":
            getattr(torch, self.device.type).manual_seed(
                seed
            )  # the current device's generator (the module's)


_running: ContextVar[BatchSeed | None] = ContextVar("running_batch_seed", default=None)


@contextmanager
def batch_draws(trainer: Trainer | None, device: torch.device) -> Iterator[None]:
    """Seeds the random draws of a training batch from the run's seed, the batch's index and the rank; the
    generators' states are restored on exit, so what the rest of the process draws does not depend on it.
    Inside, :func:`seed_part` reseeds for each part of the step. No-op outside a fit."""
    fit_loop = getattr(trainer, "fit_loop", None)  # none under Fabric
    if fit_loop is None or not getattr(trainer, "training", False):  # no fit running: a plain loop
        yield
        return
    # total_batch_idx is restored from a checkpoint: the seed of a batch survives a resume
    running = BatchSeed(global_seed(), fit_loop.total_batch_idx, trainer.global_rank, device)
    accelerated = device.type != "cpu"
    with torch.random.fork_rng(devices=[device] if accelerated else [], device_type=device.type):
        running.seed((running.rank,))
        token = _running.set(running)
        try:
            yield
        finally:
            _running.reset(token)


def seed_part(part: str, rank: int | None = None) -> None:
    """Reseeds the generators for one part of the running training batch (one of :data:`STEP_PARTS`), drawing
    for DDP rank ``rank``'s rows of the global batch (default: this process's). No-op outside
    :func:`batch_draws`."""
    running = _running.get()
    if running is None:
        return
    if part not in STEP_PARTS:
        raise ValueError(f"seed_part: unknown part {part!r}; one of {STEP_PARTS}")
    running.seed((running.rank if rank is None else rank, 1 + STEP_PARTS.index(part)))
