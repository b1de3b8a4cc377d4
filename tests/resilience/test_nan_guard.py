"""NaNGuard: skipped steps leave parameters untouched, are counted and logged, K in a row stop every rank."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from mm_lightning.callbacks.nan_guard import NaNGuard, NonFiniteTrainingError
from tests.resilience.helpers import (
    SaveParamsAtEnd,
    TinyModule,
    UnsyncedNaNGuard,
    flat_params,
    random_loader,
    run_on_two_ranks,
)


class ParamsAfterEachStep(Callback):
    """Records the flat parameters after every training batch."""

    def __init__(self) -> None:
        self.history: list[torch.Tensor] = []

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self.history.append(flat_params(pl_module))


def _fit(module: TinyModule, callbacks: list[Callback], steps: int = 5, **trainer_kwargs: Any) -> Trainer:
    trainer = Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **trainer_kwargs,
    )
    trainer.fit(module, random_loader())
    return trainer


@pytest.mark.parametrize("poison_graph", [True, False], ids=["nan-gradients", "nan-loss-finite-gradients"])
def test_nonfinite_step_is_skipped_without_touching_parameters(poison_graph: bool) -> None:
    guard, recorder = NaNGuard(max_consecutive=3), ParamsAfterEachStep()
    trainer = _fit(TinyModule(poison={0: [2]}, poison_graph=poison_graph), [guard, recorder])
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
    _fit(TinyModule(poison={0: [2]}, poison_graph=True), [recorder])
    assert torch.isfinite(recorder.history[1]).all()
    assert not torch.isfinite(recorder.history[2]).all()


def test_consecutive_nonfinite_steps_stop_with_clear_error() -> None:
    with pytest.raises(NonFiniteTrainingError, match=r"3 consecutive .*global steps 1\.\.3.*rank\(s\) \[0\]"):
        _fit(TinyModule(poison={0: [1, 2, 3]}), [NaNGuard(max_consecutive=3)], steps=8)


def test_non_consecutive_skips_do_not_stop() -> None:
    guard = NaNGuard(max_consecutive=2)
    trainer = _fit(TinyModule(poison={0: [1, 3, 5]}), [guard], steps=7)
    assert trainer.global_step == 7 and guard.skipped_steps == 3


def test_skip_counter_is_checkpointed() -> None:
    guard = NaNGuard()
    guard.load_state_dict({"skipped_steps": 4, "consecutive": 1})
    assert guard.state_dict() == {"skipped_steps": 4, "consecutive": 1}


def _ddp_fit(out_dir: str, guard_cls: type[NaNGuard], max_consecutive: int, poison: dict[int, list[int]]) -> None:
    callbacks = [guard_cls(max_consecutive=max_consecutive), SaveParamsAtEnd(out_dir)]
    _fit(TinyModule(poison=poison), callbacks, steps=6, devices=2, strategy="ddp")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("guard_cls", [NaNGuard, UnsyncedNaNGuard], ids=["synced", "control-unsynced"])
def test_loss_nan_on_one_rank_only_gives_same_decision_everywhere(tmp_path: Path, guard_cls: type) -> None:
    # The NaN enters rank 1's loss through a constant term, so the all-reduced gradients stay finite: only the
    # exchanged flags can tell rank 0 to skip too.
    run_on_two_ranks(partial(_ddp_fit, guard_cls=guard_cls, max_consecutive=3, poison={1: [2, 3]}), tmp_path)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["global_step"] == r1["global_step"] == 6
    if guard_cls is NaNGuard:
        assert r0["skipped_steps"] == r1["skipped_steps"] == 2
        assert r0["logged_skipped"].item() == r1["logged_skipped"].item() == 2.0
        assert torch.equal(r0["params"], r1["params"])
        assert torch.isfinite(r0["params"]).all()
    else:  # without the exchange, rank 0 steps while rank 1 skips: the replicas drift apart
        assert (r0["skipped_steps"], r1["skipped_steps"]) == (0, 2)
        assert not torch.equal(r0["params"], r1["params"])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_nan_on_one_rank_stops_every_rank(tmp_path: Path) -> None:
    run_on_two_ranks(partial(_ddp_fit, guard_cls=NaNGuard, max_consecutive=2, poison={1: [1, 2]}), tmp_path)
    for rank in (0, 1):
        message = (tmp_path / f"rank{rank}.err").read_text()
        assert message.startswith("NonFiniteTrainingError: NaNGuard: 2 consecutive optimizer steps")
        assert "loss was non-finite on rank(s) [1]" in message
    assert not (tmp_path / "rank0.pt").exists()  # training did not reach its end on any rank
