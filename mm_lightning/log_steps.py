"""When Lightning sends a training batch's ``self.log`` values to the loggers, from the trainer's public state.

Values logged on other steps never reach a logger; skipping them saves Lightning's per-call bookkeeping of
``self.log`` (docs/benchmarks.md, training overhead) and, for counts gathered across ranks or kept on the device,
an all-reduce or a host sync per step.
"""

from __future__ import annotations

from lightning.pytorch import Trainer


def loggers_write_this_step(trainer: Trainer | None, steps_before: int | None = None) -> bool:
    """Whether the loggers receive this training batch's logged values (``True`` without a trainer: a plain loop).

    Lightning writes at every ``log_every_n_steps``-th optimizer step, counting the one this batch leads to, when
    the run is stopping, and always under ``fast_dev_run``. Counts optimizer steps as ``trainer.global_step``
    does (one optimizer, automatic optimization).

    Args:
        trainer: The running trainer.
        steps_before: Optimizer steps done before this batch; default ``trainer.global_step``, which is that
            until the batch's optimizer step (``training_step``, ``on_before_optimizer_step``), not after it
            (``on_train_batch_end``: pass the value read at ``on_train_batch_start``).
    """
    if trainer is None or trainer.fast_dev_run:
        return True
    every = trainer.log_every_n_steps
    steps = trainer.global_step if steps_before is None else steps_before
    return every > 0 and ((steps + 1) % every == 0 or trainer.should_stop)


def ends_epoch_or_run(trainer: Trainer) -> bool:
    """Whether this training batch is its epoch's last or leads to the run's last optimizer step (``max_steps``);
    values logged then are current in ``trainer.callback_metrics`` when the epoch or the run ends."""
    if 0 < trainer.max_steps <= trainer.global_step + 1:
        return True
    return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
