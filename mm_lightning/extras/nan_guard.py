"""NaN/Inf guard: skip optimizer steps whose loss or gradient norm is not finite, stop after K in a row.
Added by ``configs/callbacks/long_run.yaml``; elsewhere ``--trainer.callbacks+=mm_lightning.extras.NaNGuard``."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from mm_lightning import ExplainedError
from mm_lightning.logging_steps import ends_epoch_or_run, loggers_write_this_step


def _grads(module: nn.Module) -> list[Tensor]:
    return [p.grad for p in module.parameters() if p.grad is not None]


@dataclass
class GradNorms:
    """The L2 norms of one step's gradients of ``module`` (computed lazily, each at most once)."""

    module: nn.Module
    step: int
    _total: Tensor | None = None
    _children: dict[str, Tensor] | None = field(default=None)

    @property
    def total(self) -> Tensor | None:
        """Norm over every parameter with a gradient (``None`` if none has one)."""
        if self._total is None:
            if self._children is not None:
                norms = list(self._children.values())
                self._total = torch.linalg.vector_norm(torch.stack(norms)) if norms else None
            else:
                grads = _grads(self.module)
                self._total = whole(torch.nn.utils.get_total_norm(grads)) if grads else None
        return self._total

    @property
    def children(self) -> dict[str, Tensor]:
        """Norm per top-level submodule (``image_encoder``, ``text_encoder``, ...) that has gradients."""
        if self._children is None:
            self._children = {}
            # a LightningModule that holds its network as ``model``: that network's parts
            network = getattr(self.module, "model", None)
            parent = network if isinstance(network, torch.nn.Module) else self.module
            for name, child in parent.named_children():
                grads = _grads(child)
                if grads:
                    self._children[name] = whole(torch.nn.utils.get_total_norm(grads))
        return self._children


def whole(norm: Tensor) -> Tensor:
    """A norm over sharded gradients (FSDP2's DTensors) summed over the shards; a plain tensor as it is."""
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


_CACHE: weakref.WeakKeyDictionary[nn.Module, GradNorms] = weakref.WeakKeyDictionary()


def step_grad_norms(module: nn.Module, step: int) -> GradNorms:
    """The shared :class:`GradNorms` of ``module`` for optimizer step ``step`` (call after backward)."""
    cached = _CACHE.get(module)
    if cached is None or cached.step != step:
        cached = GradNorms(module, step)
        _CACHE[module] = cached
    return cached


class NonFiniteTrainingError(ExplainedError, RuntimeError):
    """Raised on every rank when too many consecutive optimizer steps had a non-finite loss or gradient."""


class NaNGuard(Callback):
    """Skip optimizer steps with a non-finite loss or gradient norm; raise after ``max_consecutive`` in a row.

    Checked after backward, DDP all-reduce and AMP unscaling, alike on all ranks. A skipped step keeps the
    parameters and optimizer state (``global_step``, schedulers advance); counted in ``train/skipped_steps``.
    16-bit ``GradScaler``: loss only. Deferred, the limit acts at the next step loggers write or at epoch end.

    Args:
        max_consecutive: Consecutive non-finite steps after which training stops (NonFiniteTrainingError).
        defer: decide on device for fused optimizers: None (default) on accelerators only, True also on CPU, False
            never (the host decides every step)."""

    def __init__(self, max_consecutive: int = 3, defer: bool | None = None) -> None:
        if max_consecutive < 1:
            raise ValueError(f"max_consecutive must be >= 1, got {max_consecutive}")
        self.max_consecutive, self.defer = max_consecutive, defer
        self.skipped_steps = 0
        self.consecutive = 0
        self._loss_nonfinite: torch.Tensor | None = None
        self._logged: int | None = None  # the count last given to self.log (None: not yet in this epoch)
        # deferred: [skipped since last read, consecutive, tripped, step reached] on device; the trip's flags
        self._pending: torch.Tensor | None = None
        self._trip_flags: torch.Tensor | None = None

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._logged = None  # Lightning starts each epoch with empty logged results

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        bad = ~torch.isfinite(loss.detach()).all()  # tensor, no host sync; ORed over one step's micro-batches
        self._loss_nonfinite = bad if self._loss_nonfinite is None else self._loss_nonfinite | bad

    @override
    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer
    ) -> None:
        device = trainer.strategy.root_device
        loss_bad = torch.zeros((), dtype=torch.bool, device=device)
        if self._loss_nonfinite is not None:
            loss_bad = self._loss_nonfinite.to(device)
        self._loss_nonfinite = None
        grad_bad = torch.zeros((), dtype=torch.bool, device=device)
        if getattr(trainer.precision_plugin, "scaler", None) is None:
            total = step_grad_norms(pl_module, trainer.global_step).total  # shared with the grad-norm monitor
            if total is not None:
                grad_bad = ~torch.isfinite(total).to(device)
        local = torch.stack([loss_bad, grad_bad]).float()
        flags = self._gather_flags(trainer, local).reshape(-1, 2).bool()
        if self._defers(trainer, optimizer):
            self._decide_on_device(trainer, optimizer, flags)
            return
        if flags.any():
            optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            self.consecutive += 1
            if self.consecutive >= self.max_consecutive:
                raise NonFiniteTrainingError(self._message(trainer, flags))
        else:
            self.consecutive = 0
        self._log_count(trainer, pl_module)

    def _log_count(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Logged when the count changes and on the steps the loggers write (self.log costs per call)."""
        if self.skipped_steps != self._logged or loggers_write_this_step(trainer):
            pl_module.log(
                "train/skipped_steps", float(self.skipped_steps), on_step=True, on_epoch=False, batch_size=1
            )
            self._logged = self.skipped_steps

    def _defers(self, trainer: Trainer, optimizer: Optimizer) -> bool:
        """Whether this step's decision stays on the device (the optimizer applies ``found_inf`` itself)."""
        if self.defer is False or getattr(trainer.precision_plugin, "scaler", None) is not None:
            return False
        if self.defer is None and trainer.strategy.root_device.type == "cpu":
            return False
        return bool(getattr(optimizer, "defaults", {}).get("fused"))

    def _decide_on_device(self, trainer: Trainer, optimizer: Optimizer, flags: torch.Tensor) -> None:
        bad = flags.any()
        # As GradScaler does for fused optimizers: the kernel skips the update where found_inf is nonzero.
        optimizer.found_inf = bad.float()  # type: ignore[attr-defined]
        if self._pending is None:
            self._pending = torch.zeros(4, dtype=torch.long, device=flags.device)
            self._pending[1].fill_(self.consecutive)  # a kernel; item assignment would copy from the host
            self._trip_flags = torch.zeros_like(flags)
        skipped, consecutive, tripped, at = self._pending.unbind()
        bad_long = bad.long()
        consecutive = (consecutive + 1) * bad_long
        trips_now = (consecutive >= self.max_consecutive) & (tripped == 0)
        self._trip_flags = torch.where(trips_now, flags, self._trip_flags)
        step = torch.full_like(at, trainer.global_step)  # numbered as the host path's message numbers it
        self._pending = torch.stack(
            [skipped + bad_long, consecutive, tripped | trips_now.long(), torch.where(trips_now, step, at)]
        )
        if loggers_write_this_step(trainer) or ends_epoch_or_run(trainer):
            self._read(trainer)
            self._log_count(trainer, trainer.lightning_module)

    def _read(self, trainer: Trainer) -> None:
        """Bring the device counts to the host (one sync); raise if a run of bad steps reached the limit."""
        if self._pending is None:
            return
        skipped, consecutive, tripped, at = self._pending.tolist()
        self.skipped_steps += skipped
        self.consecutive = consecutive
        self._pending[0].zero_()
        if tripped:
            flags = self._trip_flags
            self._pending = None
            self.consecutive = self.max_consecutive
            raise NonFiniteTrainingError(self._message(trainer, flags, at))

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        for optimizer in trainer.optimizers:
            if hasattr(optimizer, "found_inf"):
                del optimizer.found_inf

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._read(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._read(trainer)

    def _gather_flags(self, trainer: Trainer, local: torch.Tensor) -> torch.Tensor:
        """All ranks' ``[loss_bad, grad_bad]`` flags; every rank receives the same tensor."""
        return trainer.strategy.all_gather(local)

    def _message(self, trainer: Trainer, flags: torch.Tensor, last: int | None = None) -> str:
        loss_ranks = flags[:, 0].nonzero().flatten().tolist()
        grad_ranks = flags[:, 1].nonzero().flatten().tolist()
        last = trainer.global_step if last is None else last
        first = last - self.consecutive + 1
        return (
            f"NaNGuard: {self.consecutive} consecutive optimizer steps (global steps {first}..{last})"
            f" had a non-finite loss or gradient norm; at the last one the loss was non-finite on rank(s)"
            f" {loss_ranks} and the gradient norm on rank(s) {grad_ranks}. {self.skipped_steps} steps were skipped"
            f" in total. Lower the learning rate or enable gradient clipping, check the data"
            f" (python -m mm_lightning audit --config ...), or raise NaNGuard(max_consecutive=...)."
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        if self._pending is not None:  # a checkpoint holds the current counts (one read)
            skipped, consecutive = self._pending[:2].tolist()
            return {"skipped_steps": self.skipped_steps + skipped, "consecutive": consecutive}
        return {"skipped_steps": self.skipped_steps, "consecutive": self.consecutive}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped_steps = state_dict["skipped_steps"]
        self.consecutive = state_dict["consecutive"]
        self._pending = None
