"""The cheaper per-step paths of the callbacks do what the per-step versions did (benchmarks/lightning_overhead.py).

* values given to ``self.log`` only on the steps the loggers write reach the loggers exactly as when logged
  every step (with a control: a plausible but wrong gate loses points);
* the NaN guard's ``train/skipped_steps`` is current in ``trainer.callback_metrics`` at every step;
* ``reseed_torch`` leaves torch's generator exactly where ``torch.manual_seed`` does.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.optim import Optimizer
from typing_extensions import override

from mm_lightning.extras.exact_resume import reseed_torch
from mm_lightning.extras.nan_guard import NaNGuard
from mm_lightning.logging_steps import loggers_write_this_step
from tests.resilience.helpers import TinyModule, random_loader
from tests.resilience.test_monitors import MemoryLogger


class LogsValue(TinyModule):
    """Logs ``train/value`` (a function of the step) every step, or only where ``gate`` says."""

    def __init__(self, gate: str) -> None:
        super().__init__()
        self.gate = gate

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        every = self.trainer.log_every_n_steps
        log = {
            "every_step": True,
            "gated": loggers_write_this_step(self.trainer),
            "gated_after_the_step": False,
            "wrong_gate": self.global_step % every == 0,  # control: off by one step
        }[self.gate]
        if log:
            self.log("train/value", float(100 * self.current_epoch + batch_idx), batch_size=1)
        return loss

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.steps_before = self.global_step

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # where a callback logs (after the optimizer step): the step count read when the batch started
        if self.gate == "gated_after_the_step" and loggers_write_this_step(self.trainer, self.steps_before):
            self.log("train/value", float(100 * self.current_epoch + batch_idx), batch_size=1)


def _logged(module: LightningModule, logger: MemoryLogger, **trainer_kwargs: Any) -> list[tuple[int, float]]:
    trainer = Trainer(
        accelerator="cpu",
        max_steps=11,  # 8 batches per epoch: crosses an epoch end, stops mid-epoch
        logger=logger,
        log_every_n_steps=3,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(module, random_loader())
    return [(step, m["train/value"]) for step, m in logger.records if "train/value" in m]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_logging_only_on_logger_steps_writes_the_same_points(accumulate: int) -> None:
    kwargs = {"accumulate_grad_batches": accumulate}
    every = _logged(LogsValue("every_step"), MemoryLogger(), **kwargs)
    assert len(every) >= 3
    assert _logged(LogsValue("gated"), MemoryLogger(), **kwargs) == every
    assert _logged(LogsValue("gated_after_the_step"), MemoryLogger(), **kwargs) == every
    assert _logged(LogsValue("wrong_gate"), MemoryLogger(), **kwargs) != every  # control: the check can fail


class GatedOnlyGuard(NaNGuard):
    """Control: logs the count only on logger steps (stale in callback_metrics in between)."""

    @property
    def _logged(self) -> int:  # always "already logged": only the logger-step condition remains
        return self.skipped_steps

    @_logged.setter
    def _logged(self, value: int | None) -> None:
        pass


class EveryStepGuard(NaNGuard):
    """The former behaviour: logs the count at every step."""

    @override
    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer
    ) -> None:
        self._logged = None
        super().on_before_optimizer_step(trainer, pl_module, optimizer)


class Probe(Callback):
    """Records (guard's count, callback_metrics value) after every batch."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float | None]] = []

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        guard = next(c for c in trainer.callbacks if isinstance(c, NaNGuard))
        value = trainer.callback_metrics.get("train/skipped_steps")
        self.seen.append((guard.skipped_steps, None if value is None else float(value)))


def _guarded(guard: NaNGuard) -> tuple[list[tuple[int, float | None]], list[tuple[int, dict]]]:
    probe, logger = Probe(), MemoryLogger()
    trainer = Trainer(
        accelerator="cpu",
        max_steps=11,
        logger=logger,
        log_every_n_steps=4,
        callbacks=[guard, probe],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyModule(poison={0: [2, 5, 6]}), random_loader())
    records = [(s, m["train/skipped_steps"]) for s, m in logger.records if "train/skipped_steps" in m]
    return probe.seen, records


def test_nan_guard_count_is_current_at_every_step_and_logged_as_before() -> None:
    seen, records = _guarded(NaNGuard(max_consecutive=5))
    assert all(value == count for count, value in seen) and seen[-1][0] == 3
    assert records == _guarded(EveryStepGuard(max_consecutive=5))[1]
    stale, _ = _guarded(GatedOnlyGuard(max_consecutive=5))
    assert any(value != count for count, value in stale)  # control: logging less often would go stale


def test_reseed_torch_sets_the_generator_like_manual_seed() -> None:
    torch.manual_seed(1234)
    expected = torch.rand(8)
    torch.rand(3)  # move the generator on
    reseed_torch(1234)
    assert torch.equal(torch.rand(8), expected)
    reseed_torch(1235)
    assert not torch.equal(torch.rand(8), expected)  # control: another seed gives another stream
