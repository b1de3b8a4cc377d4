"""Every use of Lightning's private API, each behind one small named function with the reason it is needed.

The project pins ``lightning>=2.6,<2.7`` (pyproject.toml). ``tests/test_lightning_compat.py`` checks that every
attribute listed by :func:`private_api` still exists, so an upgrade that renames one fails there, naming it,
instead of deep inside a resumed run. When upgrading Lightning: run that test, fix the functions below, widen
the pin.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.fabric.utilities import cloud_io
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.overrides import distributed
from lightning.pytorch.utilities.combined_loader import CombinedLoader


def private_api() -> list[tuple[str, Any, str]]:
    """``(owner name, owner, attribute)`` for every private name used below, on live objects.

    Instance attributes are only visible on instances, so a throwaway ``Trainer`` and ``ModelCheckpoint`` are
    built. Used by ``tests/test_lightning_compat.py``.
    """
    trainer = Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    checkpoint = ModelCheckpoint()
    return [
        ("FitLoop", trainer.fit_loop, "_combined_loader_states_to_load"),
        ("FitLoop", trainer.fit_loop, "_combined_loader"),
        ("FitLoop", trainer.fit_loop, "_data_fetcher"),
        ("CombinedLoader", CombinedLoader, "_load_state_dicts"),
        ("ModelCheckpoint", checkpoint, "_every_n_train_steps"),
        ("Trainer", trainer, "_logger_connector"),
        ("_LoggerConnector", trainer._logger_connector, "should_update_logs"),
        ("ModelCheckpoint", checkpoint, "_should_skip_saving_checkpoint"),
        ("ModelCheckpoint", checkpoint, "_save_topk_checkpoint"),
        ("ModelCheckpoint", checkpoint, "_save_last_checkpoint"),
        ("ModelCheckpoint", checkpoint, "_monitor_candidates"),
        ("ModelCheckpoint", checkpoint, "_last_global_step_saved"),
        ("ModelCheckpoint", checkpoint, "_last_checkpoint_saved"),
        ("lightning.fabric.utilities.cloud_io", cloud_io, "_is_local_file_protocol"),
        ("lightning.pytorch.overrides.distributed", distributed, "_sync_module_states"),
        ("LightningCLI", LightningCLI, "_get"),
        ("LightningCLI", LightningCLI, "_parser"),
        ("LightningCLI", LightningCLI, "_instantiate_trainer"),
    ]


# --- FitLoop: the train loader's saved position -------------------------------------------------------------


def apply_pending_train_loader_state(trainer: Trainer) -> bool:
    """Apply a checkpoint's train-loader position that Lightning read but did not apply; restart the iterator.

    Why: Lightning 2.6 applies the saved ``StatefulDataLoader`` state in ``FitLoop.setup_data``. When
    ``configure_optimizers`` reads ``trainer.estimated_stepping_batches`` the loader is set up *before* the
    checkpoint's loop state is read, so the state stays in ``_combined_loader_states_to_load`` and the resumed
    epoch would start over with a new shuffle. There is no public hook to re-apply it.

    Args:
        trainer: The trainer at ``on_train_start``.

    Returns:
        Whether a pending state was applied.
    """
    fit_loop = trainer.fit_loop
    pending = fit_loop._combined_loader_states_to_load
    if not pending or fit_loop._combined_loader is None or fit_loop._data_fetcher is None:
        return False
    fit_loop._combined_loader._load_state_dicts(pending)
    fit_loop._combined_loader_states_to_load = []
    iter(fit_loop._data_fetcher)  # a new iterator from the restored position (the old one only prefetched)
    return True


# --- ModelCheckpoint: saving last.ckpt and top-k at chosen moments ------------------------------------------


def writes_logs_this_step(trainer: Trainer | None) -> bool:
    """Whether the loggers receive this training step's ``self.log`` values (every ``log_every_n_steps``).

    Why: values logged on other steps reach TensorBoard never; skipping them saves Lightning's per-call
    bookkeeping (~0.5-1 ms per ``self.log`` on a CPU core). Exactly the test Lightning applies after the batch
    (``_LoggerConnector.should_update_logs``, plus ``fast_dev_run``); without a trainer (a plain loop) ``True``.
    """
    if trainer is None:
        return True
    return bool(trainer.fast_dev_run) or trainer._logger_connector.should_update_logs


def ends_training_or_epoch(trainer: Trainer) -> bool:
    """Whether this training batch is the epoch's last or the run's last optimizer step (``max_steps``).

    Why: Lightning keeps ``is_last_batch`` on the training loop's private batch progress (set after the batch is
    fetched, before ``training_step``); values logged only on logging steps are also logged here, so that what
    reads ``trainer.callback_metrics`` at an epoch's or the run's end sees them current.
    """
    if 0 < trainer.max_steps <= trainer.global_step + 1:
        return True
    return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


def every_n_train_steps(checkpoint: ModelCheckpoint) -> int:
    """The callback's ``every_n_train_steps`` (0 when unset).

    Why: ``ModelCheckpoint`` keeps the constructor argument only as a private attribute.
    """
    return checkpoint._every_n_train_steps


def should_skip_saving(checkpoint: ModelCheckpoint, trainer: Trainer) -> bool:
    """Lightning's own "no save now" rule (fast_dev_run, sanity check, not fitting, already saved this step).

    Why: reused so that a validation-time top-k save follows exactly the stock conditions.
    """
    return checkpoint._should_skip_saving_checkpoint(trainer)


def save_topk(checkpoint: ModelCheckpoint, trainer: Trainer) -> None:
    """Consider the current state for the top-k ("best") checkpoints with the current metrics.

    Why: stock ``ModelCheckpoint`` only does this from its own hooks, where step-triggered saves compare against
    the previous validation's metric; the public API has no "save top-k now".
    """
    checkpoint._save_topk_checkpoint(trainer, checkpoint._monitor_candidates(trainer))


def save_last(checkpoint: ModelCheckpoint, trainer: Trainer) -> None:
    """Write ``last.ckpt`` now (every rank must call; rank 0 writes).

    Why: the public API has no "save last now"; ``trainer.save_checkpoint`` would bypass the callback's naming
    and its bookkeeping (``last_model_path``) that ``--ckpt_path last`` relies on.
    """
    checkpoint._save_last_checkpoint(trainer, checkpoint._monitor_candidates(trainer))


def last_saved(checkpoint: ModelCheckpoint) -> tuple[int | None, str]:
    """``(global step, path)`` of the callback's latest save.

    Why: a last-only save must be undone in this bookkeeping, or the stock top-k logic skips the step's
    deferred "best" checkpoint at the next validation.
    """
    return checkpoint._last_global_step_saved, checkpoint._last_checkpoint_saved


def set_last_saved(checkpoint: ModelCheckpoint, step: int | None, path: str) -> None:
    """Restore the bookkeeping read by :func:`last_saved`."""
    checkpoint._last_global_step_saved, checkpoint._last_checkpoint_saved = step, path


# --- Fabric / strategy helpers (module attributes looked up at call time, so an upgrade that removes one
# breaks only its user and the compat test, not ``import mm_lightning``) ------------------------------------------------------------------------------


def is_local_path(path: str | os.PathLike) -> bool:
    """Whether ``path`` is on the local filesystem (no ``s3://``-style protocol).

    Why: Lightning decides local vs. fsspec with this helper; using it keeps the atomic-save decision identical
    to where Lightning itself would write.
    """
    return cloud_io._is_local_file_protocol(path)


def sync_module_states(module: torch.nn.Module) -> None:
    """Broadcast parameters and buffers from rank 0 (what DDP does when it wraps a model).

    Why: a strategy that does not wrap the model in ``DistributedDataParallel`` must do this itself; Lightning's
    helper is the one its own strategies use.
    """
    distributed._sync_module_states(module)


# --- LightningCLI: callback groups a config dropped ----------------------------------------------------------


def instantiate_trainer_without_dropped_callbacks(cli: LightningCLI, **kwargs: Any) -> Trainer:
    """``LightningCLI.instantiate_trainer`` leaving out the callback groups a config set to ``null``.

    Why: a group added with ``required=False`` may be ``None``; Lightning's own ``instantiate_trainer`` passes it
    on to ``Trainer(callbacks=[..., None])``, which fails. There is no public hook between reading the groups and
    building the trainer.
    """
    extra = [cli._get(cli.config_init, key) for key in cli._parser(cli.subcommand).callback_keys]
    trainer_config = {**cli._get(cli.config_init, "trainer", default={}), **kwargs}
    return cli._instantiate_trainer(trainer_config, [c for c in extra if c is not None])
