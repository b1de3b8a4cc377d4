"""The project's collectives: all-gathers (with or without gradient) and padding helpers; in a single process
each returns its input, so callers never branch on world size."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torchmetrics.utilities.distributed import gather_all_tensors

from mm_lightning import ExplainedError

_LOCAL = threading.local()


class CollectiveError(ExplainedError, RuntimeError):
    """A collective failed: a peer process died, hung or became unreachable."""


def world() -> tuple[int, int]:
    """(rank, world_size) of the default group; (0, 1) when not distributed or in :func:`single_process`."""
    if dist.is_available() and dist.is_initialized() and not getattr(_LOCAL, "single", False):
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextmanager
def single_process() -> Iterator[None]:
    """Within the block the project's collectives and losses act as in one process (no communication)."""
    before = getattr(_LOCAL, "single", False)
    _LOCAL.single = True
    try:
        yield
    finally:
        _LOCAL.single = before


def gather_with_grad(tensor: Tensor) -> Tensor:
    """Concatenates every rank's same-shaped ``tensor`` along dim 0; the gradient flows back to its rank."""
    if world()[1] == 1:
        return tensor
    return _GatherWithGrad.apply(tensor)


class _GatherWithGrad(torch.autograd.Function):
    """All-gather whose backward sums each slice's gradient over the ranks (a reduce-scatter).

    Hand-written, synchronous: torch.distributed.nn's all_gather is deprecated, its successor crashed gloo."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, tensor: Tensor) -> Tensor:
        return gather_no_grad(tensor)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> Tensor:
        rank, size = dist.get_rank(), dist.get_world_size()
        grad = grad.contiguous()
        if dist.get_backend() == "nccl":
            local = torch.empty_like(grad.chunk(size)[rank])
            dist.reduce_scatter_tensor(local, grad)
            return local
        # gloo has no reduce-scatter: sum the whole gradient, keep this rank's slice
        total = grad.clone()
        dist.all_reduce(total)
        return total.chunk(size)[rank].contiguous()


def gather_no_grad(tensor: Tensor) -> Tensor:
    """Concatenates every rank's same-shaped ``tensor`` along dim 0 without gradient (ids, masks, weights)."""
    size = world()[1]
    if size == 1:
        return tensor
    out = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(out, tensor.contiguous())
    return torch.cat(out, dim=0)


def gather_rows(tensor: Tensor) -> Tensor:
    """Concatenates every rank's rows along dim 0 when ranks hold different row counts (no gradient)."""
    if world()[1] == 1:
        return tensor
    return torch.cat(gather_all_tensors(tensor.detach()))


def pad_to_global_length(tokens: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Pads (B, L, D) tokens and (B, L) mask along L to the longest L over all ranks (for gathering)."""
    if world()[1] == 1:
        return tokens, mask
    length = torch.tensor([tokens.shape[1]], device=tokens.device)
    dist.all_reduce(length, op=dist.ReduceOp.MAX)
    extra = int(length.item()) - tokens.shape[1]
    if extra == 0:
        return tokens, mask
    return F.pad(tokens, (0, 0, 0, extra)), F.pad(mask, (0, extra), value=False)


def all_reduce_mean(tensor: Tensor) -> Tensor:
    """Mean of ``tensor`` over the ranks (a new tensor; the input is left unchanged)."""
    size = world()[1]
    if size == 1:
        return tensor
    total = tensor.clone()
    dist.all_reduce(total)
    return total / size
