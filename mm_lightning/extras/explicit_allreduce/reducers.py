"""Explicit gradient all-reduce: the textbook per-parameter loop and a bucketed variant.

Both reducers leave every participating rank with the same gradients DDP would produce:

* A rank whose gradient for a parameter is ``None`` (parameter not used in its forward) contributes zeros,
  so every rank issues the same collectives in the same order (the naive ``if p.grad is not None:
  all_reduce(p.grad)`` deadlocks when ranks disagree).
* A parameter that no rank used keeps ``grad=None``, as DDP with ``find_unused_parameters=True`` does;
  this matters for optimizers with weight decay or momentum, which skip ``None`` gradients.

The usage agreement costs one extra small collective per reduction (a ``uint8`` flag per parameter).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Parameter


def assign_buckets(params: Sequence[Tensor], cap_bytes: int) -> list[list[int]]:
    """Groups parameter indices into buckets of at most ``cap_bytes``, in reverse order, one dtype/device each.

    Reverse order approximates the order in which backward produces gradients (as DDP assumes); a parameter
    larger than the cap gets a bucket of its own.
    """
    buckets: list[list[int]] = []
    open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    for index in reversed(range(len(params))):
        param = params[index]
        key = (param.dtype, param.device)
        members, size = open_buckets.get(key, ([], 0))
        nbytes = param.numel() * param.element_size()
        if members and size + nbytes > cap_bytes:
            buckets.append(members)
            members, size = [], 0
        open_buckets[key] = (members + [index], size + nbytes)
    buckets.extend(members for members, _ in open_buckets.values() if members)
    return buckets


class GradientReducer(ABC):
    """Averages the gradients of a fixed, ordered list of parameters across the process group.

    Args:
        params: the parameters to reduce, in the same order on every rank.
        group: the process group (``None``: the default group).
        divisor: what the sum is divided by (``None``: the group's size, a mean).
    """

    def __init__(
        self, params: Sequence[Parameter], group: dist.ProcessGroup | None = None, divisor: int | None = None
    ) -> None:
        for param in params:
            if param.is_sparse or param.layout != torch.strided:
                raise ValueError("ExplicitAllReduceDDPStrategy supports dense (strided) parameters only.")
        self.params = list(params)
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.divisor = divisor or self.world_size

    @abstractmethod
    def reduce(self) -> None:
        """Averages ``param.grad`` over all ranks, in place."""

    def arm(self) -> None:  # noqa: B027 - optional hook: only overlapping reducers act on it
        """Called right before the backward that completes a step; reducers that overlap start watching."""

    def close(self) -> None:  # noqa: B027 - optional hook: only reducers holding hooks act on it
        """Releases hooks; the reducer is not used afterwards."""

    def _globally_used(self) -> list[bool]:
        """Agrees across ranks on which parameters received a gradient on at least one rank."""
        if not self.params:
            return []
        device = self.params[0].device
        flags = torch.tensor([p.grad is not None for p in self.params], dtype=torch.uint8, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return flags.bool().tolist()

    @staticmethod
    def _grad_or_zeros(param: Parameter) -> Tensor:
        if param.grad is None:
            param.grad = torch.zeros_like(param, memory_format=torch.preserve_format)
        return param.grad


class PerParameterReducer(GradientReducer):
    """A plain loop: one ``all_reduce(SUM)`` per parameter, then divide by the world size.

    Sum-then-divide equals DDP's divide-then-sum bit for bit when the world size is a power of two (the
    division is then exact); other world sizes can differ in the last bit.
    """

    def reduce(self) -> None:
        """Averages ``param.grad`` over all ranks, one collective per parameter."""
        for param, used in zip(self.params, self._globally_used(), strict=True):
            if not used:
                continue
            grad = self._grad_or_zeros(param)
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.group)
            grad.div_(self.divisor)


class BucketedReducer(GradientReducer):
    """Flattens gradients into buckets of at most ``bucket_cap_mb`` and issues one collective per bucket.

    Like DDP, each gradient is multiplied by ``1 / world_size`` while it is copied into the bucket and the
    bucket is then summed, so the result is bit-identical to DDP's for any world size (gloo has no AVG op).
    Buckets follow reverse parameter order (the order in which backward produces gradients, as in DDP) and
    never mix dtypes or devices.

    Args:
        params: the parameters to reduce, in the same order on every rank.
        bucket_cap_mb: the maximum bucket size in megabytes (a larger single parameter gets its own bucket).
        group: the process group (``None``: the default group).
        divisor: what the sum is divided by (``None``: the group's size, a mean).
    """

    def __init__(
        self,
        params: Sequence[Parameter],
        bucket_cap_mb: float = 25.0,
        group: dist.ProcessGroup | None = None,
        divisor: int | None = None,
    ) -> None:
        super().__init__(params, group, divisor)
        self.buckets = assign_buckets(self.params, int(bucket_cap_mb * 1024 * 1024))
        # Flat buffers are allocated once and reused every step (DDP keeps its buckets alive the same way).
        self._flat: list[Tensor | None] = [None] * len(self.buckets)

    def reduce(self) -> None:
        """Averages ``param.grad`` over all ranks, one collective per bucket."""
        used = self._globally_used()
        for bucket_index, members in enumerate(self.buckets):
            if not any(used[i] for i in members):
                continue
            flat = self._fill(bucket_index, members)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            self._unpack(flat, members, used)

    def _fill(self, bucket_index: int, members: list[int]) -> Tensor:
        flat = self._flat[bucket_index]
        if flat is None:
            first = self.params[members[0]]
            numel = sum(self.params[i].numel() for i in members)
            flat = self._flat[bucket_index] = torch.empty(numel, dtype=first.dtype, device=first.device)
        offset = 0
        scale = 1.0 / self.divisor
        for i in members:
            param = self.params[i]
            view = flat[offset : offset + param.numel()]
            if param.grad is None:
                view.zero_()
            elif param.grad.is_sparse:
                raise ValueError(
                    "ExplicitAllReduceDDPStrategy does not support sparse gradients; use DDPStrategy."
                )
            else:
                torch.mul(param.grad.reshape(-1), scale, out=view)
            offset += param.numel()
        return flat

    def _unpack(self, flat: Tensor, members: list[int], used: list[bool]) -> None:
        offset = 0
        for i in members:
            param = self.params[i]
            view = flat[offset : offset + param.numel()].view_as(param)
            offset += param.numel()
            if not used[i]:
                continue
            if param.grad is None:
                param.grad = view.clone()
            else:
                param.grad.copy_(view)


class OverlappingBucketedReducer(BucketedReducer):
    """Bucketed reduction whose collectives start during the last backward (what DDP's C++ reducer does).

    A post-accumulate-grad hook on every parameter counts gradients as backward produces them; once all
    parameters of the *next* bucket have theirs, that bucket is filled and launched asynchronously, so
    communication overlaps the rest of the backward. Buckets are launched strictly in index order, so all
    ranks issue the same collective sequence even when a parameter is unused on some rank (its bucket and
    the later ones are then launched after backward, with zeros for the missing gradient). Which parameters
    no rank used is agreed after the buckets, off the backward's critical path.

    Args:
        params: the parameters to reduce, in the same order on every rank.
        bucket_cap_mb: the maximum bucket size in megabytes.
        group: the process group (``None``: the default group).
    """

    def __init__(
        self, params: Sequence[Parameter], bucket_cap_mb: float = 25.0, group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__(params, bucket_cap_mb, group)
        self._bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        self._armed = False
        self._seen: set[int] = set()
        self._missing: list[int] = []
        self._next = 0
        self._works: list[dist.Work] = []
        self.overlapped_buckets = 0  # buckets launched during the last backward, for tests and benchmarks
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)
        ]

    def arm(self) -> None:
        """Starts watching for gradients: call it right before the backward that completes the step."""
        self._armed = True
        self._seen.clear()
        self._missing = [len(members) for members in self.buckets]
        self._next = 0
        self._works = []
        self.overlapped_buckets = 0

    def _make_hook(self, index: int) -> Callable[[Tensor], None]:
        def on_grad_ready(_: Tensor) -> None:
            if not self._armed:
                return
            if index in self._seen:
                # A second accumulation after the bucket may have been sent would be silently lost.
                raise RuntimeError(
                    f"ExplicitAllReduceDDPStrategy(overlap_backward=True): parameter {index} received its gradient "
                    "twice in one backward (reentrant checkpointing?); use overlap_backward=False."
                )
            self._seen.add(index)
            self._missing[self._bucket_of[index]] -= 1
            while self._next < len(self.buckets) and self._missing[self._next] == 0:
                self._launch_next()
                self.overlapped_buckets += 1

        return on_grad_ready

    def _launch_next(self) -> None:
        flat = self._fill(self._next, self.buckets[self._next])
        self._works.append(dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True))
        self._next += 1

    def reduce(self) -> None:
        """Launches the buckets backward did not complete, waits for all, and writes the averages back."""
        if not self._armed:  # e.g. manual optimization: nothing was launched during backward
            self.arm()
        while self._next < len(self.buckets):
            self._launch_next()
        used = self._globally_used()
        for work in self._works:
            work.wait()
        for bucket_index, members in enumerate(self.buckets):
            flat = self._flat[bucket_index]
            assert flat is not None
            self._unpack(flat, members, used)
        self._armed = False

    def close(self) -> None:
        """Removes the gradient hooks (the strategy calls this at teardown)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
