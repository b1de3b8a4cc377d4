"""NaNGuard in one process: skipped steps leave parameters untouched, are counted and logged, K in a row stop."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from mm_lightning.extras.nan_guard import NaNGuard, NonFiniteTrainingError
from tests.resilience.helpers import TinyModule, fit_tiny, flat_params


class ParamsAfterEachStep(Callback):
    """Records the flat parameters after every training batch."""

    def __init__(self) -> None:
        self.history: list[torch.Tensor] = []

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self.history.append(flat_params(pl_module))


@pytest.mark.parametrize("poison_graph", [True, False], ids=["nan-gradients", "nan-loss-finite-gradients"])
def test_nonfinite_step_is_skipped_without_touching_parameters(poison_graph: bool) -> None:
    guard, recorder = NaNGuard(max_consecutive=3), ParamsAfterEachStep()
    trainer = fit_tiny(TinyModule(poison={0: [2]}, poison_graph=poison_graph), [guard, recorder])
    history = recorder.history
    # Step 2 was skipped: AdamW with weight decay and momentum would have moved every parameter otherwise.
    assert torch.equal(history[2], history[1])
    assert not torch.equal(history[3], history[2])
    assert all(torch.isfinite(h).all() for h in history)
    assert guard.skipped_steps == 1 and guard.consecutive == 0
    assert trainer.callback_metrics["train/skipped_steps"].item() == 1.0


def test_without_guard_the_poisoned_step_corrupts_parameters() -> None:
    """Control: the poisoned step really poisons; the guard above is what keeps the parameters."""
    recorder = ParamsAfterEachStep()
    fit_tiny(TinyModule(poison={0: [2]}, poison_graph=True), [recorder])
    assert torch.isfinite(recorder.history[1]).all()
    assert not torch.isfinite(recorder.history[2]).all()


def test_consecutive_nonfinite_steps_stop_with_clear_error() -> None:
    with pytest.raises(NonFiniteTrainingError, match=r"3 consecutive .*global steps 1\.\.3.*rank\(s\) \[0\]"):
        fit_tiny(TinyModule(poison={0: [1, 2, 3]}), [NaNGuard(max_consecutive=3)], steps=8)


def test_non_consecutive_skips_do_not_stop() -> None:
    guard = NaNGuard(max_consecutive=2)
    trainer = fit_tiny(TinyModule(poison={0: [1, 3, 5]}), [guard], steps=7)
    assert trainer.global_step == 7 and guard.skipped_steps == 3


def test_skip_counter_is_checkpointed() -> None:
    guard = NaNGuard()
    guard.load_state_dict({"skipped_steps": 4, "consecutive": 1})
    assert guard.state_dict() == {"skipped_steps": 4, "consecutive": 1}
