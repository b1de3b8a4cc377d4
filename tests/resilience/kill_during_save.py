"""Save checkpoint A, then hang halfway through writing checkpoint B to the same path (a test SIGKILLs us).

``python -m tests.resilience.kill_during_save TARGET {atomic,direct}``: ``atomic`` saves through
:class:`~mm_lightning.checkpoints.AtomicCheckpointIO`; ``direct`` (the control) writes B straight into TARGET
as a naive ``torch.save(checkpoint, path)`` would. ``TARGET.writing`` appears once half of B is on disk.
"""

from __future__ import annotations

import io
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from mm_lightning.checkpoints import AtomicCheckpointIO

_real_save = torch.save


def _half_save_then_hang(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
    buffer = io.BytesIO()
    _real_save(obj, buffer, *args, **kwargs)
    data = buffer.getvalue()
    f.write(data[: len(data) // 2])
    f.flush()
    os.fsync(f.fileno())
    Path(sys.argv[1] + ".writing").touch()
    time.sleep(120)


def main() -> None:
    target, mode = Path(sys.argv[1]), sys.argv[2]
    AtomicCheckpointIO().save_checkpoint({"global_step": 1, "weight": torch.ones(1000)}, target)
    torch.save = _half_save_then_hang
    checkpoint_b = {"global_step": 2, "weight": torch.zeros(1000)}
    if mode == "atomic":
        AtomicCheckpointIO().save_checkpoint(checkpoint_b, target)
    else:
        with open(target, "wb") as f:
            torch.save(checkpoint_b, f)


if __name__ == "__main__":
    main()
