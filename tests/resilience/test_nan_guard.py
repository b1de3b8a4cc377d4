"""NaNGuard: skipped steps leave parameters untouched, are counted and logged, K in a row stop every rank."""

from __future__ import annotations

import os
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


SCENARIOS = {  # name: (guard class, max_consecutive, {rank: poisoned global steps})
    "synced": (NaNGuard, 3, {1: [2, 3]}),
    "control-unsynced": (UnsyncedNaNGuard, 3, {1: [2, 3]}),
    "stop": (NaNGuard, 2, {1: [1, 2]}),
}


def _ddp_scenarios(out_dir: str) -> None:
    # One pair of processes runs every scenario (process start-up dominates the cost of these tiny fits).
    for name, (guard_cls, max_consecutive, poison) in SCENARIOS.items():
        run_dir = Path(out_dir) / name
        run_dir.mkdir(exist_ok=True)
        callbacks = [guard_cls(max_consecutive=max_consecutive), SaveParamsAtEnd(str(run_dir))]
        try:
            _fit(TinyModule(poison=poison), callbacks, steps=6, devices=2, strategy="ddp")
        except NonFiniteTrainingError as error:
            (run_dir / f"rank{int(os.environ['RANK'])}.err").write_text(str(error))


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("nan_guard_ddp")
    run_on_two_ranks(_ddp_scenarios, out)
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", ["synced", "control-unsynced"])
def test_loss_nan_on_one_rank_only_gives_same_decision_everywhere(ddp_results: Path, scenario: str) -> None:
    # The NaN enters rank 1's loss through a constant term, so the all-reduced gradients stay finite: only the
    # exchanged flags can tell rank 0 to skip too.
    r0, r1 = (torch.load(ddp_results / scenario / f"rank{r}.pt") for r in (0, 1))
    assert r0["global_step"] == r1["global_step"] == 6
    if scenario == "synced":
        assert r0["skipped_steps"] == r1["skipped_steps"] == 2
        assert r0["logged_skipped"].item() == r1["logged_skipped"].item() == 2.0
        assert torch.equal(r0["params"], r1["params"])
        assert torch.isfinite(r0["params"]).all()
    else:  # without the exchange, rank 0 steps while rank 1 skips: the replicas drift apart
        assert (r0["skipped_steps"], r1["skipped_steps"]) == (0, 2)
        assert not torch.equal(r0["params"], r1["params"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_nan_on_one_rank_stops_every_rank(ddp_results: Path) -> None:
    for rank in (0, 1):
        message = (ddp_results / "stop" / f"rank{rank}.err").read_text()
        assert message.startswith("NaNGuard: 2 consecutive optimizer steps (global steps 1..2)")
        assert "loss was non-finite on rank(s) [1]" in message
        assert not (ddp_results / "stop" / f"rank{rank}.pt").exists()  # training did not reach its end
