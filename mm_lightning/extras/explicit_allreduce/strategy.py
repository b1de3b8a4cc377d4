"""``ExplicitAllReduceDDPStrategy``: DDP's process group and launcher, with gradients reduced by hand.

Select it with ``--trainer.strategy ddp_explicit`` on the CLI (the name is registered by
:mod:`mm_lightning.config_parser`), or ``Trainer(strategy=ExplicitAllReduceDDPStrategy(...))`` in Python. The model is *not* wrapped in
``DistributedDataParallel``; the strategy does DDP's duties itself:

* parameters and buffers are broadcast from rank 0 when fitting starts;
* buffers (BatchNorm statistics) are broadcast from rank 0 before a forward exactly when DDP would do it;
* gradients are averaged once per optimizer step, after the last micro-batch's backward and before
  GradScaler unscaling and gradient clipping (the closure is wrapped in :meth:`optimizer_step`);
* under manual optimization users call :meth:`reduce_gradients` between ``manual_backward`` and ``step``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.nn import Module, Parameter
from torch.optim import Optimizer
from typing_extensions import override

from mm_lightning import gloo_exit_abort
from mm_lightning.distributed import CollectiveError
from mm_lightning.extras.explicit_allreduce.reducers import (
    BucketedReducer,
    GradientReducer,
    OverlappingBucketedReducer,
    PerParameterReducer,
)

ReductionMode = Literal["per_parameter", "bucketed"]


class ExplicitAllReduceDDPStrategy(DDPStrategy):
    """Multi-process data parallelism with an explicit, user-visible gradient all-reduce.

    Args:
        mode: ``"per_parameter"`` (the textbook loop: one ``all_reduce(SUM)`` per parameter, then divide) or
            ``"bucketed"`` (gradients flattened into buckets, one collective per bucket).
        bucket_cap_mb: the bucket size for ``mode="bucketed"``, in megabytes.
        overlap_backward: with ``mode="bucketed"``, start each bucket's all-reduce during the last backward,
            as soon as its gradients exist (post-accumulate-grad hooks), instead of after it.
        timeout_s: seconds a collective may wait for its peers before the process fails (gloo and NCCL
            process-group timeout); bounds how long a rank waits when another one dies or hangs.
        process_group_backend: ``"gloo"``, ``"nccl"`` or ``None`` (Lightning picks from the device).
        start_method: how Lightning starts local processes; ``"popen"`` re-runs the script (CLI default),
            ``"spawn"`` suits notebooks and tests.

    The Trainer sets the accelerator, devices, cluster environment (torchrun, SLURM, ... detected
    automatically) and precision plugin, so they are not constructor arguments (which keeps the CLI's
    ``--trainer.strategy.*`` options to the ones above).
    """

    def __init__(
        self,
        mode: ReductionMode = "bucketed",
        bucket_cap_mb: float = 25.0,
        overlap_backward: bool = False,
        timeout_s: float = 1800.0,
        process_group_backend: str | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        if mode not in ("per_parameter", "bucketed"):
            raise ValueError(f"mode must be 'per_parameter' or 'bucketed', got {mode!r}")
        if overlap_backward and mode != "bucketed":
            raise ValueError("overlap_backward=True needs mode='bucketed'")
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        super().__init__(
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=timeout_s),
            start_method=start_method,
        )
        self.mode = mode
        self.bucket_cap_mb = bucket_cap_mb
        self.overlap_backward = overlap_backward
        self.timeout_s = timeout_s
        self._reducers: dict[tuple[int, ...], GradientReducer] = {}
        # DDP's `require_forward_param_sync`: None outside fitting (no buffer sync, like an unwrapped model).
        self._sync_buffers_before_forward: bool | None = None
        self._grad_sync_blocked = False
        self._backward_since_reduce = False

    # ------------------------------------------------------------------ setup / teardown
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        gloo_exit_abort.install()  # gloo ranks would otherwise abort at interpreter exit (see gloo_exit_abort.py)

    @override
    def configure_ddp(self) -> None:
        # Instead of wrapping in DistributedDataParallel, do what its constructor does: rank 0's state wins.
        assert self.model is not None
        self._collective("broadcast parameters and buffers from rank 0", sync_module_states, self.model)
        self._close_reducers()
        self._sync_buffers_before_forward = True

    @override
    def teardown(self) -> None:
        self._sync_buffers_before_forward = None
        self._close_reducers()
        super().teardown()

    def _close_reducers(self) -> None:
        for reducer in self._reducers.values():
            reducer.close()
        self._reducers.clear()

    # ------------------------------------------------------------------ gradients
    def reduce_gradients(self, optimizer: Optimizer | None = None) -> None:
        """Averages gradients across all processes (call it before ``optimizer.step()`` in manual optimization).

        Every rank must call it at the same point. Gradients that are ``None`` on some ranks count as zeros;
        parameters no rank computed a gradient for keep ``grad=None``.

        Args:
            optimizer: reduce only this optimizer's parameters (a ``LightningOptimizer`` is accepted); by
                default all trainable parameters of the LightningModule.
        """
        self._collective(f"gradient all-reduce ({self.mode})", self._reducer_for(optimizer).reduce)
        self._backward_since_reduce = False

    def _reducer_for(self, optimizer: Optimizer | None) -> GradientReducer:
        # Keyed by the parameter list, so freezing or unfreezing parameters mid-training builds a new reducer.
        params = self._trainable_params(optimizer)
        key = tuple(id(p) for p in params)
        if key not in self._reducers:
            self._reducers[key] = self._make_reducer(params)
        return self._reducers[key]

    def _trainable_params(self, optimizer: Optimizer | None) -> list[Parameter]:
        if optimizer is None:
            assert self.lightning_module is not None
            candidates: Iterable[Parameter] = self.lightning_module.parameters()
        else:
            inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
            candidates = (p for group in inner.param_groups for p in group["params"])
        seen: set[int] = set()
        params = []
        for param in candidates:
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
        return params

    def _make_reducer(self, params: list[Parameter]) -> GradientReducer:
        if self.mode == "per_parameter":
            return PerParameterReducer(params)
        if self.overlap_backward:
            return OverlappingBucketedReducer(params, bucket_cap_mb=self.bucket_cap_mb)
        return BucketedReducer(params, bucket_cap_mb=self.bucket_cap_mb)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Runs the closure, reduces the gradients, then lets the precision plugin unscale, clip and step.

        Args:
            optimizer: the optimizer performing the step.
            closure: runs the last micro-batch's forward and backward (automatic optimization).
            model: the LightningModule.
            **kwargs: forwarded to ``optimizer.step``.
        """
        assert self.lightning_module is not None
        automatic = self.lightning_module.automatic_optimization

        def closure_then_reduce() -> Any:
            if automatic:
                self._reducer_for(None).arm()
            result = closure()
            if automatic:
                self.reduce_gradients()
            elif self._backward_since_reduce:
                raise RuntimeError(
                    "ExplicitAllReduceDDPStrategy with manual optimization: call "
                    "`self.trainer.strategy.reduce_gradients(optimizer)` after `self.manual_backward(...)` "
                    "and before `optimizer.step()`; otherwise each process steps with its own gradients."
                )
            return result

        return super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        self._backward_since_reduce = True
        super().post_backward(closure_loss)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Marks accumulation micro-batches (no gradient reduction, and DDP syncs no buffers after them)."""
        self._grad_sync_blocked = True
        try:
            yield None
        finally:
            self._grad_sync_blocked = False

    # ------------------------------------------------------------------ buffers
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        self._maybe_broadcast_buffers()
        output = super().training_step(*args, **kwargs)
        self._after_forward()
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        self._maybe_broadcast_buffers()
        output = super().validation_step(*args, **kwargs)
        self._after_forward()
        return output

    def _maybe_broadcast_buffers(self) -> None:
        if not self._sync_buffers_before_forward:
            return
        assert self.lightning_module is not None
        buffers = list(self.lightning_module.buffers())
        if buffers:
            self._collective("buffer broadcast from rank 0", _broadcast_coalesced, buffers)

    def _after_forward(self) -> None:
        # Mirrors DDP's `_post_forward`: the next forward syncs buffers only if this one was a gradient-syncing
        # training forward. In manual optimization Lightning switches DDP's grad sync off around the forward,
        # so DDP never re-syncs buffers there; neither do we.
        if self._sync_buffers_before_forward is None:
            return
        assert self.lightning_module is not None
        self._sync_buffers_before_forward = (
            torch.is_grad_enabled()
            and not self._grad_sync_blocked
            and self.lightning_module.automatic_optimization
        )

    # ------------------------------------------------------------------ failures
    def _collective(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs collectives, turning a dead or hung peer into one clear error instead of a backend trace."""
        try:
            return fn(*args)
        except (RuntimeError, dist.DistError) as error:
            raise CollectiveError(
                f"ExplicitAllReduceDDPStrategy: {what} failed on rank {self.global_rank} of {self.world_size}. "
                f"Another training process probably died, was killed or stopped responding (collective "
                f"timeout: {self.timeout_s:g} s). Backend error: {error}"
            ) from error


def _broadcast_coalesced(tensors: list[Tensor], src: int = 0) -> None:
    """Broadcasts ``tensors`` from ``src`` with one collective per dtype/device (DDP coalesces buffers too)."""
    groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    with torch.no_grad():
        for group in groups.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            dist.broadcast(flat, src=src)
            offset = 0
            for tensor in group:
                tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()


def sync_module_states(module: Module) -> None:
    """Copies rank 0's parameters and buffers to every rank, as ``DistributedDataParallel`` does when it wraps a
    model (one broadcast per tensor, in place: once per fit, no extra copy of the model)."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.numel() > 0:
                dist.broadcast(tensor.data, src=0)
