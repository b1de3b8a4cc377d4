"""What each of the 2 processes of test_evaluation's ``val/loss`` check runs: every validation it compares, in one
process group (the processes are started by ``tests/strategies/launch.py``; rank 0 writes the losses as JSON).

    python tests/models/val_loss_worker.py <clean.jsonl> <with_broken.jsonl> <out.json>
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from mm_lightning import gloo_exit_abort
from tests.models.test_evaluation import BATCH_SIZES, _val_loss

if __name__ == "__main__":
    gloo_exit_abort.install()  # as the CLI does for a run of more than one process
    clean, with_broken, out = map(Path, sys.argv[1:4])
    losses = {
        f"{name}/{batch_size}": _val_loss(records, batch_size, 2, out.parent / f"{name}_{batch_size}")
        for name, records in (("clean", clean), ("with_broken", with_broken))
        for batch_size in BATCH_SIZES
    }
    if os.environ["RANK"] == "0":
        out.write_text(json.dumps(losses))
