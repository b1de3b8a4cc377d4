"""After a resume with another global batch: the learning rates follow ``model.optim.lr_scaling`` and the
schedule's length counts the steps the run really takes."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from mm_lightning.data.resume import planned_steps, rescale_for_global_batch
from mm_lightning.models.optim import warmup_cosine


def trainer_after(change: tuple[int, int] | None, planned: float | None = None) -> SimpleNamespace:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    scheduler = warmup_cosine(optimizer, 0, lambda: 100, 0.0)
    loader = SimpleNamespace(global_batch_change=change, planned_steps=planned)
    return SimpleNamespace(
        train_dataloader=loader,
        optimizers=[optimizer],
        lr_scheduler_configs=[SimpleNamespace(scheduler=scheduler)],
        estimated_stepping_batches=40,
    )


@pytest.mark.parametrize(("rule", "factor"), [("none", 1.0), ("linear", 0.5), ("sqrt", math.sqrt(0.5))])
def test_learning_rates_follow_the_rule_for_a_halved_global_batch(rule: str, factor: float) -> None:
    trainer = trainer_after((256, 128))
    rescale_for_global_batch(trainer, rule)
    (group,) = trainer.optimizers[0].param_groups
    assert group["lr"] == pytest.approx(0.1 * factor)
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    scheduler.step()  # the next step's rate follows from the scaled peak
    assert group["lr"] == pytest.approx(scheduler.lr_lambdas[0](1) * 0.1 * factor)


def test_a_resume_on_the_same_global_batch_changes_nothing() -> None:
    trainer = trainer_after(None)
    rescale_for_global_batch(trainer, "linear")
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.1
    assert planned_steps(trainer) == 40  # Lightning's estimate
    assert planned_steps(trainer_after((8, 4), planned=18)) == 18  # control: counted across the change
