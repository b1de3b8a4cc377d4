"""The run's seed (:func:`global_seed`) and seeds derived from it, so that a random draw depends only on the run's
seed and what the draw is for (an epoch, a batch, an item), not on the process or the order of earlier draws."""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence

import numpy as np


def global_seed(default: int = 0) -> int:
    """The seed ``seed_everything`` set for this run (``default`` if none was set)."""
    return int(os.environ.get("PL_GLOBAL_SEED", default))


def derive_seed(base: int, values: Sequence[int] | np.ndarray | int) -> int:
    """A 32-bit seed that is a pure function of ``base`` and ``values`` (a batch index, item indices...)."""
    data = np.asarray(values, dtype=np.int64).reshape(-1).tobytes()
    return zlib.crc32(data, base & 0xFFFFFFFF)  # not hash(): stable across processes and Python versions


def derived_rng(base: int, *values: int) -> np.random.Generator:
    """A NumPy generator that is a pure function of ``base`` (low 32 bits) and ``values`` (epoch, item...)."""
    return np.random.default_rng([base & 0xFFFFFFFF, *values])
