"""NaNGuard with a fused optimizer decides on the device: the same skips as the host path, no per-step read."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.optim import Optimizer
from typing_extensions import override

from mm_lightning.extras.nan_guard import NaNGuard, NonFiniteTrainingError
from mm_lightning.logging_steps import ends_epoch_or_run, loggers_write_this_step
from tests.resilience.helpers import TinyModule, fit_tiny
from tests.resilience.test_nan_guard import ParamsAfterEachStep

HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__")


@contextmanager
def _counting_host_reads(calls: list[str]):
    """Records every tensor -> Python value conversion (each one is a host sync on an accelerator)."""
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def wrap(name: str, original: Any) -> Any:
        def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return original(self, *args, **kwargs)

        return counted

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


class ProbedGuard(NaNGuard):
    """Records, per optimizer step, whether the guard read a tensor on the host and whether it may (log/end)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.steps: list[tuple[bool, bool]] = []

    @override
    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer
    ) -> None:
        calls: list[str] = []
        may_read = loggers_write_this_step(trainer) or ends_epoch_or_run(trainer)
        with _counting_host_reads(calls):
            super().on_before_optimizer_step(trainer, pl_module, optimizer)
        self.steps.append((bool(calls), may_read))


@pytest.mark.parametrize("poison_graph", [True, False], ids=["nan-gradients", "nan-loss-finite-gradients"])
def test_deferred_skips_equal_the_host_paths(poison_graph: bool) -> None:
    histories, guards = [], []
    for defer in (True, False):
        guard, recorder = NaNGuard(max_consecutive=3, defer=defer), ParamsAfterEachStep()
        torch.manual_seed(0)
        fit_tiny(
            TinyModule(poison={0: [2, 4]}, poison_graph=poison_graph, fused=True), [guard, recorder], steps=7
        )
        histories.append(recorder.history)
        guards.append(guard)
    deferred, host = histories
    assert all(torch.equal(a, b) for a, b in zip(deferred, host, strict=True))
    assert torch.equal(deferred[2], deferred[1]) and torch.equal(deferred[4], deferred[3])  # skipped
    assert not torch.equal(deferred[3], deferred[2])
    assert guards[0].skipped_steps == guards[1].skipped_steps == 2


def test_control_a_fused_step_without_the_flag_corrupts_parameters() -> None:
    recorder = ParamsAfterEachStep()
    fit_tiny(TinyModule(poison={0: [2]}, poison_graph=True, fused=True), [recorder])
    assert torch.isfinite(recorder.history[1]).all() and not torch.isfinite(recorder.history[2]).all()


def test_deferred_reads_the_host_only_on_logging_and_last_steps() -> None:
    guard = ProbedGuard(max_consecutive=3, defer=True)
    trainer = fit_tiny(TinyModule(poison={0: [2]}, fused=True), [guard], steps=11, log_every_n_steps=4)
    assert any(read for read, _ in guard.steps)
    assert all(may for read, may in guard.steps if read)  # no read on any other step
    assert guard.skipped_steps == 1 and trainer.callback_metrics["train/skipped_steps"].item() == 1.0
    control = ProbedGuard(max_consecutive=3, defer=False)  # the host path reads every step
    fit_tiny(TinyModule(poison={0: [2]}, fused=True), [control], steps=11, log_every_n_steps=4)
    assert all(read for read, _ in control.steps)


def test_deferred_stop_names_the_steps_that_reached_the_limit() -> None:
    guard = NaNGuard(max_consecutive=3, defer=True)
    with pytest.raises(NonFiniteTrainingError, match=r"3 consecutive .*global steps 1\.\.3.*rank\(s\) \[0\]"):
        fit_tiny(TinyModule(poison={0: [1, 2, 3]}, fused=True), [guard], steps=8, log_every_n_steps=50)
    assert guard.skipped_steps >= 3


def test_deferred_counts_are_in_checkpoints_and_not_used_without_a_fused_optimizer() -> None:
    guard = ProbedGuard(defer=True)

    class SaveState(Callback):
        @override
        def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
            self.state = guard.state_dict()

    saver = SaveState()
    fit_tiny(TinyModule(poison={0: [3]}, fused=True), [guard, saver], steps=5, log_every_n_steps=50)
    assert saver.state == {"skipped_steps": 1, "consecutive": 0}
    plain = ProbedGuard(defer=True)  # a for-loop AdamW cannot take the flag: the host path decides
    fit_tiny(TinyModule(poison={0: [3]}), [plain], steps=5, log_every_n_steps=50)
    assert all(read for read, _ in plain.steps) and plain.skipped_steps == 1


class SyncCheckedGuard(ProbedGuard):
    """On CUDA: any host sync inside the guard's hook on a step where it need not read raises (torch's check)."""

    @override
    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer
    ) -> None:
        may_read = loggers_write_this_step(trainer) or ends_epoch_or_run(trainer)
        torch.cuda.set_sync_debug_mode("warn" if may_read else "error")
        try:
            super().on_before_optimizer_step(trainer, pl_module, optimizer)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a host sync only exists with a CUDA device")
def test_no_host_sync_per_step_on_cuda() -> None:
    guard = SyncCheckedGuard(
        max_consecutive=3
    )  # defer=None: deferred on an accelerator with a fused optimizer
    trainer = fit_tiny(
        TinyModule(poison={0: [2]}, fused=True),
        [guard],
        steps=11,
        log_every_n_steps=4,
        accelerator="gpu",
        devices=1,
    )
    assert guard.skipped_steps == 1 and trainer.callback_metrics["train/skipped_steps"].item() == 1.0
    assert not all(read for read, _ in guard.steps)  # the deferred path ran (the host path reads every step)
