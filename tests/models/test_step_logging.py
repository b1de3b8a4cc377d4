"""The training step logs its loss every step and its details (terms, temperature, weights) when they are written."""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger

from tests.models.helpers import pair_loader, tiny_module


def fit(tmp_path: Path, log_every_n_steps: int, **trainer: object) -> tuple[dict[str, list[int]], Trainer]:
    """Runs a tiny fit; returns, per logged name, the optimizer steps at which the module called ``self.log``."""
    torch.manual_seed(0)
    model = tiny_module()
    calls: dict[str, list[int]] = {}
    log = model.log

    def recording_log(name: str, *args: object, **kwargs: object) -> None:
        if model.trainer.training:
            calls.setdefault(name, []).append(model.trainer.global_step)
        log(name, *args, **kwargs)

    model.log = recording_log
    run = Trainer(
        accelerator="cpu",
        logger=CSVLogger(tmp_path),
        log_every_n_steps=log_every_n_steps,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
        **trainer,
    )
    run.fit(model, pair_loader(batch_size=8))
    return calls, run


def written_steps(run: Trainer, name: str) -> list[int]:
    rows = (Path(run.logger.log_dir) / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    column, step = header.index(name), header.index("step")
    return [int(r.split(",")[step]) for r in rows[1:] if r.split(",")[column]]


def test_details_are_logged_on_written_steps_and_at_the_end_and_the_loss_every_step(tmp_path: Path) -> None:
    calls, run = fit(tmp_path, log_every_n_steps=3, max_steps=7)
    assert calls["train/loss"] == list(range(7))
    for name in ("train/loss_itc", "train/loss_itm", "train/temperature", "train/weight_itc"):
        assert calls[name] == [2, 5, 6], name  # log_every_n_steps=3: steps 2 and 5, then max_steps' last step
    # the loggers receive the same points as the loss's (the step the CSV rows carry)
    assert written_steps(run, "train/loss_itc") == written_steps(run, "train/loss") == [2, 5]
    # read at the end of fit, the details are the last step's
    temperature = run.lightning_module.model.contrastive.temperature
    torch.testing.assert_close(run.callback_metrics["train/temperature"], temperature.detach())


def test_control_logging_every_step_logs_the_details_every_step(tmp_path: Path) -> None:
    calls, _ = fit(tmp_path, log_every_n_steps=1, max_steps=4)
    assert calls["train/loss_itc"] == calls["train/loss"] == [0, 1, 2, 3]


def test_each_epochs_last_batch_logs_the_details(tmp_path: Path) -> None:
    calls, run = fit(tmp_path, log_every_n_steps=50, max_epochs=2)
    per_epoch = run.num_training_batches
    assert calls["train/loss_itc"] == [per_epoch - 1, 2 * per_epoch - 1]
