"""Counts the operations that make the host wait for the device (a host sync), on any device, CPU included.

On a GPU these read a value back (``.item()``, ``bool(t)``, ``int(t)``) or size an output by the data (boolean
indexing, ``nonzero``, ``repeat_interleave`` without ``output_size``, ``torch.multinomial``'s checks); on a CPU they
cost nothing, so a test counts them here to keep a GPU step free of them. Not seen on a CPU: ``.tolist()``,
``.cpu()``, ``.numpy()`` and blocking host-to-device copies, which dispatch no operation there; on a GPU,
``torch.cuda.set_sync_debug_mode`` sees them (``benchmarks/gpu_check.py``'s profile stage)."""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import Callback
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# ops whose output shape or value needs the device's data on the host
DATA_DEPENDENT = {
    aten._local_scalar_dense.default,  # .item(), bool(), int(), float()
    aten.nonzero.default,
    aten.masked_select.default,
    aten.multinomial.default,  # checks its probabilities on the host
    aten.unique_consecutive.default,
    aten._unique2.default,
    aten.equal.default,
    aten.is_nonzero.default,
}
# ops that sync when an index is a boolean mask
MASK_INDEXED = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
}


def _is_sync(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    if func in DATA_DEPENDENT:
        return True
    if func in MASK_INDEXED:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)
    if func is aten.repeat_interleave.Tensor or func is aten.repeat_interleave.self_Tensor:
        return kwargs.get("output_size") is None
    return False


@dataclass
class HostSyncs(TorchDispatchMode):
    """A dispatch mode that records each host sync with the line of project or test code that caused it."""

    records: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if _is_sync(func, args, kwargs):
            self.records.append((str(func), _caller()))
        return func(*args, **kwargs)


def _caller() -> str:
    """The innermost frame outside torch itself: where the sync was asked for."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "/torch/" not in frame.filename or "/torch/optim/" in frame.filename:
            return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return "?"


@contextmanager
def host_syncs() -> Iterator[HostSyncs]:
    """Records the host syncs of the block: ``with host_syncs() as syncs: ...; assert not syncs.records``."""
    mode = HostSyncs()
    with mode:
        yield mode


class StepSyncs(Callback):
    """Records a fit's host syncs by optimizer step (``steps[global_step]``), validation apart.

    Add it last (``--trainer.callbacks+=tests.host_syncs.StepSyncs``): it counts from its own
    ``on_train_batch_start`` of one step to the next, so every other hook of the step is inside."""

    def __init__(self) -> None:
        self.steps: dict[int, list[tuple[str, str]]] = {}
        self.validation: list[tuple[str, str]] = []
        self.mode: HostSyncs | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.mode = HostSyncs()
        self.mode.__enter__()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.mode.records = self.steps.setdefault(trainer.global_step, [])

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self.mode is not None:
            self.mode.records = self.validation

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._stop()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._stop()  # the mode must not outlive a failed fit in the test process

    def _stop(self) -> None:
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.mode = None
