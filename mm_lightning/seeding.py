"""The run's seed and every seed derived from it: the one place that reads ``PL_GLOBAL_SEED``.

``seed_everything`` (the CLI's ``--seed_everything``) records the seed in ``PL_GLOBAL_SEED``, which spawned
workers and DDP processes inherit; everything that needs "the run's seed" asks :func:`global_seed`, and every
per-batch seed comes from :func:`derive_seed` (a generator from :func:`derived_rng`), so a batch's random draws
depend only on the run's seed and that batch's identity (its position, epoch or item indices), never on worker
layout or resume point.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence

import numpy as np


def global_seed(default: int = 0) -> int:
    """The seed ``seed_everything`` set for this run (``default`` if none was set)."""
    return int(os.environ.get("PL_GLOBAL_SEED", default))


def derive_seed(base: int, values: Sequence[int] | np.ndarray | int) -> int:
    """A 32-bit seed that is a pure function of ``base`` and ``values`` (e.g. a batch index or item indices).

    CRC32 rather than Python's ``hash``: stable across processes and Python versions for any sequence.

    Args:
        base: the run's seed.
        values: what identifies the batch.
    """
    data = np.asarray(values, dtype=np.int64).reshape(-1).tobytes()
    return zlib.crc32(data, base & 0xFFFFFFFF)


def derived_rng(base: int, *values: int) -> np.random.Generator:
    """A NumPy generator that is a pure function of ``base`` and ``values`` (e.g. an epoch, an item index).

    Args:
        base: the run's seed (its low 32 bits).
        values: what identifies the draw.
    """
    return np.random.default_rng([base & 0xFFFFFFFF, *values])
