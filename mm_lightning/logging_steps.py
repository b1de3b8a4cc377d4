"""Which training steps the loggers write: the module logs its costlier values, and the callbacks read the device,
only on those steps (``trainer.log_every_n_steps``), so that the other steps never wait for the device."""

from __future__ import annotations

from lightning.pytorch import Trainer


def loggers_write_this_step(trainer: Trainer | None, steps_before: int | None = None) -> bool:
    """Whether loggers receive this training batch's logged values (``True`` without a trainer).

    From ``on_train_batch_end`` pass ``steps_before``: ``global_step`` read at ``on_train_batch_start``."""
    if trainer is None or trainer.fast_dev_run:
        return True
    every = trainer.log_every_n_steps
    steps = trainer.global_step if steps_before is None else steps_before
    return every > 0 and ((steps + 1) % every == 0 or trainer.should_stop)


def ends_epoch_or_run(trainer: Trainer) -> bool:
    """Whether this training batch is its epoch's last or leads to the run's last step (``max_steps``)."""
    if 0 < trainer.max_steps <= trainer.global_step + 1:
        return True
    return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
