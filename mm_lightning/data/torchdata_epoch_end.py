"""Workaround: torchdata's ``StatefulDataLoader`` resumed from a state saved after an epoch's last batch yields an
empty next epoch (torchdata 0.11; meta-pytorch/data#1437).

Reproduction::

    from torchdata.stateful_dataloader import StatefulDataLoader
    loader = StatefulDataLoader(range(8), batch_size=2)
    batches = iter(loader)
    [next(batches) for _ in range(4)]  # the epoch's 4 batches, taken by count as Lightning does
    resumed = StatefulDataLoader(range(8), batch_size=2)
    resumed.load_state_dict(loader.state_dict())
    list(resumed)  # the next epoch: [] instead of its 4 batches (a second epoch then has them)

Why: the iterator never saw its own end (Lightning stops after ``len(loader)`` batches without asking for one more),
so the saved state says "4 of 4 yielded, not finished"; loading it fast-forwards a fresh iterator past the end.

Workaround: :class:`ResumableDataLoader` counts the batches it yielded and, when a loaded state is at the epoch's
end, runs that iterator to its end at load, so the next ``iter`` starts the next epoch.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

from torchdata.stateful_dataloader import StatefulDataLoader
from typing_extensions import override

from mm_lightning.data.loader import StartsWorkersOutsideTheGroup


class ResumableDataLoader(StartsWorkersOutsideTheGroup, StatefulDataLoader):
    """``StatefulDataLoader`` that also resumes from a state saved after an epoch's last batch, and that saves and
    restores the sampler's epoch (Lightning calls ``set_epoch`` only after creating the iterator)."""

    BATCHES_KEY = "mm_lightning_batches_yielded"
    EPOCH_KEY = "mm_lightning_sampler_epoch"
    _yielded = 0  # batches this epoch's iterator yielded (incl. before a resume); 0 once it ended by itself
    _resumed_at = 0  # batches already yielded in the epoch a loaded state resumes
    position_loaded = False  # a resumed run checks that Lightning applied the saved position

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with warnings.catch_warnings():
            # torchdata 0.11 calls set_vital, which torch flags as deprecated; not the user's concern
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
            super().__init__(*args, **kwargs)

    @override
    def __iter__(self) -> Iterator[Any]:
        batches = super().__iter__()
        self._yielded, self._resumed_at = self._resumed_at, 0
        return self._counted(batches)

    def _counted(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            self._yielded += 1
            yield batch
        self._yielded = 0  # ended by itself: torchdata's own state then starts the next epoch

    def _epoch_samplers(self) -> list[Any]:
        samplers = (self.sampler, getattr(self.batch_sampler, "sampler", None))
        return [s for s in samplers if hasattr(s, "set_epoch") and isinstance(getattr(s, "epoch", None), int)]

    def _set_epoch(self, epoch: int) -> None:
        for sampler in self._epoch_samplers():
            sampler.set_epoch(epoch)

    @override
    def state_dict(self) -> dict[str, Any]:
        state = {**super().state_dict(), self.BATCHES_KEY: self._yielded}
        for sampler in self._epoch_samplers()[:1]:
            state[self.EPOCH_KEY] = sampler.epoch
        return state

    @staticmethod
    def _torchdata_count(state: dict[str, Any]) -> int:
        """Batches yielded in the epoch by torchdata's state (0 once its iterator had ended by itself)."""
        if state.get("_iterator_finished"):
            return 0
        if "_snapshot" in state:  # with workers
            snapshot_step = int(state["_snapshot"].get("_snapshot_step", 0))
            return snapshot_step + int(state.get("_steps_since_snapshot", 0))
        return int(state.get("_num_yielded", 0))

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        yielded = state.pop(self.BATCHES_KEY, None)
        if yielded is None:  # a state saved by a plain StatefulDataLoader: torchdata's own count
            yielded = self._torchdata_count(state)
        epoch = state.pop(self.EPOCH_KEY, None)
        super().load_state_dict(state)
        self.position_loaded = True
        if epoch is not None:
            self._set_epoch(epoch)
        if yielded and yielded >= len(self):
            for _ in super().__iter__():  # the epoch's rest: nothing left, only the iterator's end is reached
                pass
            self._resumed_at = self._yielded = 0
            if epoch is not None:
                self._set_epoch(epoch + 1)
        else:  # also what state_dict reports until the next iterator starts
            self._resumed_at = self._yielded = yielded
