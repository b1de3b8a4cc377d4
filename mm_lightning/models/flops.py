"""FLOPs of one batch, measured once with torch's ``FlopCounterMode`` (for Lightning's ``ThroughputMonitor``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch.utils.flop_counter import FlopCounterMode


class FlopsMeter:
    """Counts the FLOPs of the first batch of each kind (e.g. ``train``: forward + backward, ``eval``).

    A batch may be counted in several pieces (the forward in ``training_step``, the backward in ``backward``);
    :meth:`finish` closes the kind, after which counting is free. ``ThroughputMonitor`` turns the number into
    FLOPs/s and, on GPUs with a known peak, MFU.
    """

    def __init__(self) -> None:
        self.totals: dict[str, int] = {}
        self._pending: dict[str, int] = {}

    @contextmanager
    def count(self, kind: str) -> Iterator[None]:
        """Counts the FLOPs run inside the block towards ``kind`` until ``kind`` is finished.

        Args:
            kind: the batch kind.
        """
        if kind in self.totals:
            yield
            return
        with FlopCounterMode(display=False) as counter:
            yield
        self._pending[kind] = self._pending.get(kind, 0) + counter.get_total_flops()

    def finish(self, kind: str) -> None:
        """Freezes the count of ``kind`` (the first complete batch).

        Args:
            kind: the batch kind.
        """
        if kind not in self.totals and kind in self._pending:
            self.totals[kind] = self._pending.pop(kind)

    def discard(self, kind: str) -> None:
        """Drops an incomplete count (e.g. a skipped step that ran no backward).

        Args:
            kind: the batch kind.
        """
        self._pending.pop(kind, None)
