"""Two gloo processes (spawned once, several scenarios): NaNGuard and PreemptionCheckpoint take the same
decision on every rank when only one rank sees the NaN or the signal."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from mm_lightning.extras import PreemptionCheckpoint
from mm_lightning.extras.nan_guard import NaNGuard, NonFiniteTrainingError
from tests.resilience.helpers import SaveParamsAtEnd, TinyModule, UnsyncedNaNGuard, fit_tiny, run_on_two_ranks


class SignalSelf(Callback):
    """Sends SIGTERM to this process after global step ``step``, on rank ``rank`` only."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


SCENARIOS = {  # name: (guard class, max_consecutive, {rank: poisoned global steps})
    "synced": (NaNGuard, 3, {1: [2, 3]}),
    "control-unsynced": (UnsyncedNaNGuard, 3, {1: [2, 3]}),
    "stop": (NaNGuard, 2, {1: [1, 2]}),
}


def _ddp_scenarios(out_dir: str) -> None:
    # One pair of processes runs every scenario (process start-up dominates the cost of these tiny fits).
    rank = int(os.environ["RANK"])
    for name, (guard_cls, max_consecutive, poison) in SCENARIOS.items():
        run_dir = Path(out_dir) / name
        run_dir.mkdir(exist_ok=True)
        callbacks = [guard_cls(max_consecutive=max_consecutive), SaveParamsAtEnd(str(run_dir))]
        try:
            fit_tiny(TinyModule(poison=poison), callbacks, steps=6, devices=2, strategy="ddp")
        except NonFiniteTrainingError as error:
            (run_dir / f"rank{rank}.err").write_text(str(error))
    run_dir = Path(out_dir) / "preempt"
    checkpoint = ModelCheckpoint(
        dirpath=run_dir / "ckpts", every_n_train_steps=1000, save_top_k=0, save_last=True
    )
    callbacks = [
        SignalSelf(rank=1, step=3),
        PreemptionCheckpoint(),
        checkpoint,
        SaveParamsAtEnd(str(run_dir)),
    ]
    try:
        fit_tiny(TinyModule(), callbacks, steps=50, devices=2, strategy="ddp")
    except SIGTERMException:
        saved = Path(checkpoint.dirpath) / "last.ckpt"
        (run_dir / f"rank{rank}.exit").write_text(str(saved) if saved.exists() else "")


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ddp")
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


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_on_one_rank_saves_and_stops_every_rank(ddp_results: Path) -> None:
    run = ddp_results / "preempt"
    for rank in (0, 1):
        assert (run / f"rank{rank}.exit").read_text().endswith("last.ckpt")
        assert not (run / f"rank{rank}.pt").exists()  # neither rank trained on to step 50
    assert torch.load(run / "ckpts" / "last.ckpt", weights_only=True)["global_step"] == 3
