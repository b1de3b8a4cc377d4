"""Atomic checkpoint writes, ``last.ckpt`` cadence, RNG state round trip, weights_only-safe checkpoints."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import TensorDataset
from typing_extensions import override

from mm_lightning.checkpoints import AtomicCheckpointIO
from mm_lightning.data.order import GlobalOrderSampler
from mm_lightning.data.resume import ResumableDataLoader, TrainPosition
from mm_lightning.extras import ExactResume, PreemptionCheckpoint
from tests.resilience.helpers import TinyModule, random_loader

REPO = Path(__file__).resolve().parents[2]


def wait_for(path: Path, process: subprocess.Popen, timeout: float = 120, log: Path | None = None) -> None:
    """Wait until ``path`` exists; fail early with the process's output (its stdout pipe, or ``log``) if it exits
    first."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None:
            output = log.read_text() if log is not None else process.stdout.read()
            raise AssertionError(f"process exited ({process.returncode}) first:\n{output}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"{path} did not appear within {timeout}s")
        time.sleep(0.05)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["atomic", "direct"], ids=["atomic", "control-direct-write"])
def test_kill_during_save_keeps_previous_checkpoint(tmp_path: Path, mode: str) -> None:
    target = tmp_path / "last.ckpt"
    cmd = [sys.executable, "-m", "tests.resilience.kill_during_save", str(target), mode]
    process = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(Path(str(target) + ".writing"), process)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    if mode == "atomic":
        checkpoint = torch.load(target, weights_only=True)
        assert checkpoint["global_step"] == 1 and torch.equal(checkpoint["weight"], torch.ones(1000))
        leftovers = list(tmp_path.glob(".tmp-last.ckpt.*"))
        assert len(leftovers) == 1  # the half-written B, next to the target, invisible to `--ckpt_path last`
        AtomicCheckpointIO().save_checkpoint({"global_step": 3}, target)
        assert torch.load(target, weights_only=True) == {"global_step": 3}
        assert not list(tmp_path.glob(".tmp-*"))  # the next successful save removes the leftover
    else:  # a plain write leaves a truncated file: the check above would catch it
        with pytest.raises(Exception):  # noqa: B017 (torch raises RuntimeError or EOFError depending on where)
            torch.load(target, weights_only=True)


class LastCheckpointSteps(Callback):
    """Collects the global steps that ``last.ckpt`` held, sampled before each batch and at the end."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.steps: set[int] = set()

    def _sample(self) -> None:
        if self.path.exists():
            self.steps.add(torch.load(self.path, weights_only=True)["global_step"])

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self._sample()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._sample()


def last_and_best(dirpath: Path, every: int | None) -> list[ModelCheckpoint]:
    """The CLI's pair of stock callbacks: the best after each validation, last.ckpt every ``every`` steps (None:
    at each epoch end)."""
    return [
        ModelCheckpoint(dirpath=dirpath, monitor="val/loss", save_top_k=1),
        ModelCheckpoint(
            dirpath=dirpath, filename="last", every_n_train_steps=every, enable_version_counter=False
        ),
    ]


def one_with_a_monitor(dirpath: Path, every: int) -> list[ModelCheckpoint]:
    """Control: one stock callback doing both (it waits for the monitored metric)."""
    return [
        ModelCheckpoint(
            dirpath=dirpath, monitor="val/loss", save_top_k=1, save_last=True, every_n_train_steps=every
        )
    ]


def fit_with(callbacks: list[Callback], epochs: int) -> None:
    trainer = Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        plugins=[AtomicCheckpointIO()],
        callbacks=callbacks,
    )
    trainer.fit(
        TinyModule(), random_loader(40), random_loader(16)
    )  # 5 steps per epoch, validation at its end


@pytest.mark.parametrize("checkpoints", [last_and_best, one_with_a_monitor], ids=["pair", "control-one"])
def test_last_checkpoint_every_n_steps_before_the_first_validation(
    tmp_path: Path, checkpoints: Callable
) -> None:
    sampler = LastCheckpointSteps(tmp_path / "last.ckpt")
    fit_with([sampler, *checkpoints(tmp_path, 3)], epochs=2)
    if checkpoints is last_and_best:
        assert sampler.steps == {3, 6, 9}
        assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["epoch=1-step=10.ckpt", "last.ckpt"]
    else:  # (Lightning 2.6.6 gives {6, 9}): waits for the monitored metric, none before the first validation
        assert 3 not in sampler.steps


@pytest.mark.parametrize("checkpoints", [last_and_best, one_with_a_monitor], ids=["pair", "control-one"])
def test_best_checkpoint_follows_each_validation(tmp_path: Path, checkpoints: Callable) -> None:
    # every_n_train_steps == steps per epoch: last.ckpt is written after step 5's batch, "best" must wait for
    # the validation that follows it.
    callbacks = checkpoints(tmp_path, 5)
    fit_with(callbacks, epochs=1)
    if checkpoints is last_and_best:
        assert Path(callbacks[0].best_model_path).name == "epoch=0-step=5.ckpt"
        assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 5
    else:  # the deferred save of "best" is dropped
        assert callbacks[0].best_model_path == ""


def test_rng_state_round_trip() -> None:
    callback = ExactResume(seed=3)
    state = callback.state_dict()
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.random(), np.random.rand(), torch.rand(5)  # move every generator on
    callback.load_state_dict(state)
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected


class ReadsLengthInConfigureOptimizers(TinyModule):
    @override
    def configure_optimizers(self) -> Any:
        self.trainer.estimated_stepping_batches  # noqa: B018 (sets up the train loader before a checkpoint is read)
        return super().configure_optimizers()


@pytest.mark.parametrize(
    "module_cls", [TinyModule, ReadsLengthInConfigureOptimizers], ids=["lazy", "control-eager"]
)
def test_resume_says_when_the_data_position_could_not_be_restored(tmp_path: Path, module_cls: type) -> None:
    def fit(ckpt_path: Path | None = None, **limits: int) -> ResumableDataLoader:
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(40, 8, generator=generator), torch.randn(40, generator=generator))
        loader = ResumableDataLoader(data, GlobalOrderSampler(40, 8), batch_size=8)
        checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=0, save_last=True)
        trainer = Trainer(
            accelerator="cpu", **limits, logger=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[checkpoint, ExactResume()],
        )  # fmt: skip
        trainer.fit(module_cls(), loader, ckpt_path=ckpt_path)
        return trainer.train_dataloader

    fit(max_steps=2)  # last.ckpt in the middle of the first epoch (5 batches)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = fit(
            tmp_path / "last.ckpt", max_epochs=1
        )  # a length in epochs: asking for it sets up the data
    said = [w for w in caught if "position in the training data was not restored" in str(w.message)]
    assert loader.position_loaded is (module_cls is TinyModule)
    assert len(said) == (module_cls is not TinyModule)


@pytest.mark.parametrize("save_at_end", [True, False], ids=["saved", "control-not-saved"])
def test_last_checkpoint_holds_the_end_of_training(tmp_path: Path, save_at_end: bool) -> None:
    """A step cadence that does not divide the run: the end is saved by the preemption callback."""
    fit_with(
        [*last_and_best(tmp_path, 3), PreemptionCheckpoint(save_at_end=save_at_end)], epochs=2
    )  # 10 steps
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == (10 if save_at_end else 9)


@pytest.mark.parametrize("best_first", [True, False], ids=["best-first", "control-last-first"])
def test_last_checkpoint_records_the_fresh_best(tmp_path: Path, best_first: bool) -> None:
    """Both save after the epoch's validation; last.ckpt must hold the best callback's state after its save, or a
    resumed run would believe an older, deleted file is the best."""
    best, last = last_and_best(tmp_path, None)
    fit_with([best, last] if best_first else [last, best], epochs=1)
    states = torch.load(tmp_path / "last.ckpt", weights_only=True)["callbacks"]
    [saved_best] = [v["best_model_path"] for k, v in states.items() if "val/loss" in k]
    assert (saved_best == best.best_model_path != "") is best_first


def test_a_saved_position_goes_only_to_a_fit_resumed_from_a_checkpoint() -> None:
    """A position read by an earlier ``validate(ckpt_path=...)`` is not given to a later fresh ``fit``."""
    data = TensorDataset(torch.arange(40.0), torch.arange(40.0))
    saved = ResumableDataLoader(data, GlobalOrderSampler(40, 8), batch_size=8)
    batches = iter(saved)
    next(batches), next(batches)
    state = {TrainPosition.KEY: saved.position_state()}
    for ckpt_path, applied in ((None, False), ("last.ckpt", True)):
        position = TrainPosition()
        position.load_state_dict(state)
        loader = position.track(
            ResumableDataLoader(data, GlobalOrderSampler(40, 8), batch_size=8),
            SimpleNamespace(ckpt_path=ckpt_path),
        )
        assert loader.position_loaded is applied and position.pending is None
        consumed = position.state_dict()[TrainPosition.KEY][ResumableDataLoader.KEY]["consumed"]
        assert consumed == (16 if applied else 0)  # 2 batches of 8


@pytest.mark.parametrize("seed", ["3", "4"], ids=["same-seed", "control-other-seed"])
def test_a_resume_with_another_seed_says_how_to_continue_exactly(
    seed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = ExactResume(seed=3).state_dict()
    monkeypatch.setenv("PL_GLOBAL_SEED", seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ExactResume().load_state_dict(state)
    said = [str(w.message) for w in caught if "pass --seed_everything 3" in str(w.message)]
    assert len(said) == (seed != "3")
